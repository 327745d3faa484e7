"""bench/roofline.py's counts: the tiny model's real parameters, and docs/benchmarking.md's M1/M2 figures."""

import pytest

from mlaserve.bench.roofline import decode_floor_s, prefill_flops, total_params
from mlaserve.config import ModelConfig
from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from mlaserve.models.make_random import load_preset


def test_counts_match_the_model():
    cfg = ModelConfig.from_hf(load_preset("tiny"))
    model = DeepseekV3ForCausalLM(cfg)
    assert total_params(cfg) == sum(p.numel() for p in model.parameters())


def test_benchmark_md_scales():
    m1 = ModelConfig.from_hf(load_preset("moonlight-16b-a3b"))
    assert total_params(m1) / 1e9 == pytest.approx(15.96, abs=0.01)
    assert decode_floor_s(m1, 1, 512) * 1e3 == pytest.approx(1.2, abs=0.05)  # "about 1.2 ms"
    raw = load_preset("kimi-k2.5")
    raw["text_config"]["num_hidden_layers"] = 4
    m2 = ModelConfig.from_hf(raw)
    assert total_params(m2) / 1e9 == pytest.approx(54.0, abs=0.05)
    assert decode_floor_s(m2, 1, 512) * 1e3 == pytest.approx(1.5, abs=0.05)  # "about 1.5 ms"
    # prefill: 2 x active params x T dominates; attention grows with T^2
    assert prefill_flops(m1, 8192) > 4 * prefill_flops(m1, 2048)


def test_chunk_floor_over_cached_context():
    """A chunk after cached context attends it too (each token's pairs with every cached one); a short suffix's
    floor is its reads (every expert's weights), a long chunk's its FLOPs."""
    from mlaserve.bench.roofline import BF16_FLOPS_PER_S, HBM_BYTES_PER_S, chunk_floor_s, decode_bytes

    m1 = ModelConfig.from_hf(load_preset("moonlight-16b-a3b"))
    H, L = m1.num_attention_heads, m1.num_hidden_layers
    extra = prefill_flops(m1, 256, context=4096) - prefill_flops(m1, 256)
    assert extra == pytest.approx(2 * 256 * 4096 * H * (m1.qk_head_dim + m1.v_head_dim) * L)
    assert chunk_floor_s(m1, 32, 4096) == decode_bytes(m1, 1, 4096, q_len=32) / HBM_BYTES_PER_S
    assert chunk_floor_s(m1, 2048, 8192) == prefill_flops(m1, 2048, context=8192) / BF16_FLOPS_PER_S


def test_quantized_floors_count_the_bytes_stored():
    """INT4 experts read 0.5 + 2/32 bytes a weight (packed words + bf16 group scales); FP8 1 + 4/128^2 (values + fp32
    block scales), except kv_b_proj, held in bf16."""
    import copy

    from mlaserve.bench.roofline import (
        FP8_BYTES,
        INT4_BYTES,
        attn_bytes,
        decode_bytes,
        expected_experts,
        param_counts,
        routed_expert_bytes,
    )
    from mlaserve.quantization import DEEPSEEK_FP8, KIMI_INT4

    raw = load_preset("kimi-k2.5")
    raw["text_config"]["num_hidden_layers"] = 4
    bf16 = ModelConfig.from_hf(raw)
    raw["text_config"]["quantization_config"] = copy.deepcopy(KIMI_INT4)
    int4 = ModelConfig.from_hf(raw)
    p = param_counts(bf16)
    assert routed_expert_bytes(int4, 8) == 8 * 3 * 7168 * 2048 * 0.5625  # the INT4 GEMV's bytes at one token
    assert routed_expert_bytes(int4, 8, moe_tp=4) == routed_expert_bytes(int4, 2)
    for batch in (1, 8):
        routed = 3 * expected_experts(bf16, batch) * p.expert  # 3 MoE layers
        saved = decode_bytes(bf16, batch, 512) - decode_bytes(int4, batch, 512)
        assert saved == pytest.approx(routed * (2 - INT4_BYTES), rel=1e-9)
    assert decode_floor_s(int4, 1, 512) * 1e3 == pytest.approx(1.12, abs=0.01)  # bf16: 1.5 (docs/benchmarking.md)

    raw = load_preset("deepseek-v3")
    raw["num_hidden_layers"] = 5
    bf16 = ModelConfig.from_hf(raw)
    raw["quantization_config"] = copy.deepcopy(DEEPSEEK_FP8)
    fp8 = ModelConfig.from_hf(raw)
    p, c = param_counts(bf16), bf16
    kv_b = c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
    assert attn_bytes(bf16) == 2 * p.attn  # unquantized: every attention weight at 2 bytes
    linears = p.attn - c.q_lora_rank - c.kv_lora_rank - 2 * c.hidden_size - kv_b
    assert attn_bytes(fp8) == pytest.approx(linears * FP8_BYTES + (p.attn - linears) * 2, rel=1e-12)
    routed = 2 * expected_experts(bf16, 1) * p.expert
    dense = 3 * p.dense_mlp + 2 * p.shared
    saved = decode_bytes(bf16, 1, 512) - decode_bytes(fp8, 1, 512)
    assert saved == pytest.approx((routed + dense + 5 * linears) * (2 - FP8_BYTES), rel=1e-9)


def test_an_fp8_kv_cache_halves_the_floor_s_kv_bytes():
    from mlaserve.bench.roofline import decode_bytes

    c = ModelConfig.from_hf(load_preset("moonlight-16b-a3b"))
    kv = 32 * (8192 + 1) * c.num_hidden_layers * c.kv_cache_dim  # values of the latent cache read by one step
    assert decode_bytes(c, 32, 8192) - decode_bytes(c, 32, 8192, kv_dtype_bytes=1) == pytest.approx(kv, abs=1)
    assert decode_bytes(c, 32, 8192, kv_dtype_bytes=2) == decode_bytes(c, 32, 8192)
