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
