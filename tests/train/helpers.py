"""A tiny DeepSeek-V3 config for the training tests, and random weights that make every feature matter."""

from __future__ import annotations

import math

import torch

from mlaserve.train.model import DeepseekV3ForTraining
from mlaserve.train.model_config import make_config

TINY = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
)


def tiny_config(vocab: int = 512, seq_len: int = 64, **overrides) -> dict:
    return make_config(vocab, 0, 1, seq_len, **{**TINY, **overrides})


def random_model(c: dict, seed: int = 0) -> DeepseekV3ForTraining:
    """Weights of std 1/sqrt(fan_in), norms near 1, routing biases big enough to change expert choices."""
    model = DeepseekV3ForTraining(c)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for moe in model.moe_layers:
            moe.gate.e_score_correction_bias.copy_(0.1 * torch.randn(moe.gate.weight.shape[0], generator=g))
    return model.eval()
