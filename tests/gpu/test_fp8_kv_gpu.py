"""The FP8 latent KV cache on CUDA at real model sizes: the store and the decode held bit for bit to their default
paths over the same values, a CUDA-graph replay reading the scale by address, and the engine (graphs, eager, torch
reference) on an FP8 cache. Run:  PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_fp8_kv_gpu.py"""

import random

import pytest
import torch

from tests.helpers import kernel_checks as kc
from tests.helpers.fp8_kv_checks import check_absorb_store_fp8, check_mla_decode_fp8, check_rope_store_kv_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_seed")]
BF = torch.bfloat16


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("T", [1, 2, 300])
def test_rope_store_kv_fp8_real_dims(norm, scale, T):
    check_rope_store_kv_fp8("cuda", BF, T=T, R=512, P=64, page_size=64, num_pages=16, norm=norm, scale=scale)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T", [1, 2])
def test_absorb_q_rope_store_kv_fp8_real_dims(norm, T):
    check_absorb_store_fp8("cuda", BF, T=T, H=16, N=128, R=512, P=64, norm=norm, scale=0.37, page_size=64)


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("H,q_len,B", [(16, 1, 16), (16, 2, 16), (128, 1, 4), (16, 1, 1), (64, 4, 8)])
def test_mla_decode_fp8_real_dims(H, q_len, B, scale):
    lens = [q_len, 8192, 64, 65, 1000 + q_len] + [random.randint(q_len, 8192) for _ in range(B)]
    check_mla_decode_fp8("cuda", BF, ctx_lens=lens[:B], H=H, R=512, P=64, page_size=64, q_len=q_len, scale=scale)


def test_mla_decode_fp8_graph_replay_reads_a_new_scale():
    from mlaserve.attention.kv_fp8 import dequantize_kv, quantize_kv
    from mlaserve.kernels.mla_decode import mla_decode
    from tests.helpers.kernel_refs import mla_decode_ref

    B, H, R, P, page = 8, 16, 512, 64, 64
    wide, table, seq_lens = kc.make_paged([4096] * B, page, R + P, torch.float32, "cuda")
    scale = torch.tensor([1.0], device="cuda")
    cache = quantize_kv(wide, scale)
    q = torch.randn(B, H, R + P, device="cuda").to(BF)
    out = torch.empty(B, H, R, device="cuda", dtype=BF)
    g, _ = kc.cuda_graph(lambda: mla_decode(q, cache, table, seq_lens, 1, 0.07, out, kv_scale=scale))
    for s, lens in ((0.5, [100, 2, 4000, 3000, 64, 65, 4096, 7]), (1.7, [4096, 1, 16, 333, 2048, 4095, 1000, 5])):
        scale.fill_(s)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        ref = mla_decode_ref(q, dequantize_kv(cache, scale, BF), table, seq_lens, 1, 0.07, R)
        kc.assert_close(out, ref, BF, f"fp8 mla_decode graph replay scale={s}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_fp8_cache_graphs_equal_eager_and_close_to_the_reference(tiny_ckpt, dtype):
    from tests.gpu.test_engine_gpu import _greedy, _prompts

    prompts = _prompts(12)
    kw = dict(dtype=dtype, kv_cache_dtype="fp8")
    ref, _ = _greedy(dict(kw, enforce_eager=True, attention_backend="torch", moe_backend="torch"), tiny_ckpt, prompts)
    eager, _ = _greedy(dict(kw, enforce_eager=True), tiny_ckpt, prompts)
    graphs, llm = _greedy(kw, tiny_ckpt, prompts)
    assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert llm.engine.runner.graphs.graph_replays["decode"] > 0
    assert graphs == eager
    # the kernels and the reference round the rows before quantization alike, but their sums differ in order: a
    # near-tie may flip, after which every later token differs; the first ones must agree
    same = sum(a[:2] == b[:2] for a, b in zip(eager, ref))
    assert same >= len(ref) - 2, (same, len(ref))


def test_fp8_cache_holds_twice_the_tokens_of_bf16_in_the_same_bytes(tiny_ckpt):
    from mlaserve import LLM

    pages = {}
    for kv in ("auto", "fp8"):
        llm = LLM(tiny_ckpt, device="cuda", dtype="bfloat16", kv_cache_dtype=kv, enforce_eager=True)
        r = llm.engine.runner
        pages[kv] = (r.num_pages, r._page_bytes(), r.kv_cache.numel() * r.kv_cache.element_size())
        del r  # the runner holds the cache: the next LLM sizes its own from the memory this one frees
        llm.close()
    assert 2 * pages["fp8"][1] == pages["auto"][1]
    assert pages["fp8"][0] >= 1.9 * pages["auto"][0], pages  # sized from free memory: about twice the pages
