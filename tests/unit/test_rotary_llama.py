"""The Llama drafts' RoPE scaling (layers/rotary_llama.py) against transformers' ROPE_INIT_FUNCTIONS."""

import pytest
import torch

from mlaserve.layers.rotary_llama import llama_rope

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3, "original_max_position_embeddings": 2048},
]  # fmt: skip


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: (s or {}).get("rope_type", (s or {}).get("type", "none")))
@pytest.mark.parametrize("head_dim,theta", [(128, 500000.0), (64, 10000.0)])
def test_llama_rope_matches_transformers(scaling, head_dim, theta):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=dict(scaling) if scaling else None,
        max_position_embeddings=131072,
    )
    ref = LlamaRotaryEmbedding(cfg)
    inv_freq, factor = llama_rope(scaling, theta, head_dim, 131072)
    torch.testing.assert_close(inv_freq, ref.inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref.attention_scaling, rel=1e-12)


def test_unsupported_rope_names_the_type():
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        llama_rope({"rope_type": "dynamic", "factor": 2.0}, 10000.0, 64, 4096)
    with pytest.raises(ValueError, match="linear needs 'factor'"):
        llama_rope({"rope_type": "linear"}, 10000.0, 64, 4096)
