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


@pytest.fixture(scope="session")
def int4_ckpt(tmp_path_factory):
    """The tiny preset with its routed experts INT4 (compressed-tensors pack-quantized, as Kimi-K2.5 publishes)."""
    from tests.helpers.quant_ckpt import make_quantized

    return make_quantized(tmp_path_factory.mktemp("int4"), "int4-experts")


@pytest.fixture(scope="session")
def fp8_ckpt(tmp_path_factory):
    """The tiny preset widened to dims that are not multiples of 128, FP8 block-quantized as DeepSeek-V3 publishes."""
    from tests.helpers.quant_ckpt import FP8_ODD, make_quantized

    return make_quantized(tmp_path_factory.mktemp("fp8"), "fp8-block", **FP8_ODD)
