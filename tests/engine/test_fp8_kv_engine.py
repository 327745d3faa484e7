"""--kv-cache-dtype fp8 through the engine: the cache in float8_e4m3fn with one scale per layer, half the bytes a
page of a bf16 cache takes (so twice the pages in the same memory), said at start; generation on it."""

import logging

import pytest
import torch

from mlaserve.engine.engine import LLMEngine
from mlaserve.types import SamplingParams

from .conftest import make_engine, run_all


def test_fp8_cache_holds_twice_the_pages_of_a_bf16_one_in_the_same_memory(tiny_ckpt, caplog):
    kw = dict(dtype="bfloat16", kv_cache_memory_gb=0.01, page_size=16)
    bf16 = make_engine(tiny_ckpt, **kw)
    with caplog.at_level(logging.INFO, logger="mlaserve.runner"):
        fp8 = make_engine(tiny_ckpt, kv_cache_dtype="fp8", **kw)
    r16, r8 = bf16.runner, fp8.runner
    assert r16.kv_cache.dtype == torch.bfloat16 and r8.kv_cache.dtype == torch.float8_e4m3fn
    assert r8.kv_scale.tolist() == [1.0] * r8.kv_cache.shape[0] and r16.kv_scale is None
    assert 2 * r8._page_bytes() == r16._page_bytes()
    budget = 0.01 * (1 << 30)
    assert r8.num_pages == int(budget // r8._page_bytes())
    assert r8.num_pages in (2 * r16.num_pages, 2 * r16.num_pages + 1)  # the floor of twice as many
    assert fp8.pool.num_pages == r8.num_pages and fp8.cache_tokens == r8.num_pages * 16
    assert r8.kv_cache.numel() * r8.kv_cache.element_size() <= budget
    assert f"KV cache: {r8.num_pages} pages x 16 tokens" in caplog.text and "float8_e4m3fn" in caplog.text
    assert "one scale per layer, 1.0" in caplog.text


def test_fp8_cache_generates_close_to_the_model_dtype_cache(tiny_ckpt):
    """Greedy on the tiny random model (fp32): on these prompts no token is near enough a tie for the cache's
    rounding to change it, so both caches give the same tokens."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [300, 17, 99, 4]]
    outs = []
    for kv in ("auto", "fp8_e4m3"):
        eng: LLMEngine = make_engine(tiny_ckpt, kv_cache_dtype=kv, page_size=4, num_pages=64)
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0), request_id=str(i))
        outs.append(run_all(eng))
    auto, fp8 = outs
    assert all(len(fp8[k]) == 8 for k in fp8)
    assert fp8 == auto


def test_engine_refuses_fp8_e5m2_naming_the_field(tiny_ckpt):
    with pytest.raises(ValueError, match="^kv_cache_dtype: 'fp8_e5m2' is not supported"):
        make_engine(tiny_ckpt, kv_cache_dtype="fp8_e5m2")
