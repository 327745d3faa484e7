"""Shared fixtures: tiny random checkpoints made once per session, and the gpu marker's skip."""

import pytest
import torch

# The test models are tiny: one intra-op thread is faster than two, and far faster when CI's 2 cores are
# shared with other jobs (thread contention made the parity tests 6x slower).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The built-in tiny preset, fp32, seed 0."""
    from mlaserve.models.make_random import make_random

    return make_random("tiny", str(tmp_path_factory.mktemp("tiny")), seed=0, dtype="float32", progress=False)
