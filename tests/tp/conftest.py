"""Fixtures of the TP tests: a second tiny checkpoint covering what the tiny preset does not."""

import pytest


@pytest.fixture(scope="session")
def tiny_variant(tmp_path_factory):
    """tiny with q_proj (no q_lora, like Moonlight), a vocab of 509 (padded over 2 ranks), two shared experts and
    two dense layers."""
    from mlaserve.models.make_random import make_random

    return make_random(
        "tiny",
        str(tmp_path_factory.mktemp("tiny_variant")),
        seed=1,
        dtype="float32",
        progress=False,
        overrides={
            "q_lora_rank": None,
            "vocab_size": 509,
            "n_shared_experts": 2,
            "first_k_dense_replace": 2,
            "num_hidden_layers": 3,
        },
    )
