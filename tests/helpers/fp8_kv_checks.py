"""Checks of the kernels that write and read the FP8 latent cache (attention/kv_fp8.py), shared by the interpreter
tests and the GPU tests. Each FP8 path is held, bit for bit, to the same kernel's default path on a cache in the
compute dtype: the stores' rows quantized by quantize_kv, the decode (scale 1.0) over a cache holding
dequantize_kv's rows; and to the torch reference."""

from __future__ import annotations

import torch

from tests.helpers.kernel_checks import make_paged, nan_like

FP8 = torch.float8_e4m3fn


def bits(x: torch.Tensor) -> torch.Tensor:
    """fp8 rows as their bytes (NaN == NaN, -0 != +0): what `equal` compares."""
    return x.view(torch.uint8)


def check_rope_store_kv_fp8(
    device, dtype, *, T: int, R: int, P: int, page_size: int, num_pages: int, norm: bool, scale
):
    """rope_store_kv into an e4m3 cache == quantize_kv(rope_store_kv into a cache of c_kv's dtype), byte for byte;
    skipped slots keep their poison (NaN)."""
    from mlaserve.attention.kv_fp8 import quantize_kv
    from mlaserve.kernels.rope_kv import rope_store_kv

    wide = nan_like((num_pages, page_size, R + P), dtype, device)
    cache = wide.to(FP8)  # NaN: e4m3fn's 0x7f
    slots = torch.randperm(num_pages * page_size, device=device)[:T]
    slots[::3] = -1  # padding tokens: skipped
    kv_a = (4 * torch.randn(T, R + P, device=device)).to(dtype)
    kv_a[0, :4] = torch.tensor([1e4, -1e4, 300.0, 1e-6])  # saturated, and rounded to e4m3's subnormals
    c_kv = kv_a[:, :R]
    k_pe = kv_a[:, R:]
    pos = torch.randint(0, 4096, (T,), device=device).float()
    freqs = pos[:, None] * (1e-4 ** (torch.arange(P // 2, device=device) / (P // 2)))
    cos, sin = freqs.cos() * 1.1, freqs.sin() * 1.1
    w = (1 + 0.1 * torch.randn(R, device=device)).to(dtype) if norm else None
    s = torch.tensor([scale], dtype=torch.float32, device=device)
    rope_store_kv(wide, slots, c_kv, k_pe, cos, sin, w, 1e-6)
    rope_store_kv(cache, slots, c_kv, k_pe, cos, sin, w, 1e-6, kv_scale=s)
    ok = slots[slots >= 0]
    flat, wflat = cache.view(-1, R + P), wide.view(-1, R + P)
    assert torch.equal(bits(flat[ok]), bits(quantize_kv(wflat[ok], s))), f"fp8 store T={T} R={R} P={P} {dtype}"
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=device)
    written[ok] = True
    assert torch.isnan(flat[~written].float()).all(), "the fp8 store wrote a slot it should have skipped"
    assert torch.isfinite(flat[written].float()).all()


def check_absorb_store_fp8(device, dtype, *, T: int, H: int, N: int, R: int, P: int, norm: bool, scale, page_size=16):
    """absorb_q_rope_store_kv into an e4m3 cache: Q equal to the same launch's into a cache of q's dtype, and the
    rows equal to quantize_kv of that launch's rows, byte for byte; skipped and untouched slots keep their NaN."""
    from mlaserve.attention.kv_fp8 import quantize_kv
    from mlaserve.kernels.head_gemv import absorb_q_rope_store_kv

    num_pages = 3
    w_kc = (torch.randn(H, N, R, device=device) / R**0.5).to(dtype)
    proj = (2 * torch.randn(T, H * (N + P) + R + P, device=device)).to(dtype)  # [q | kv_a] of one GEMM
    q, kv_a = proj[:, : H * (N + P)].view(T, H, N + P), proj[:, H * (N + P) :]
    pos = torch.randint(0, 4096, (T,), device=device).float()
    freqs = pos[:, None] * (1e-4 ** (torch.arange(P // 2, device=device) / (P // 2)))
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.randperm(num_pages * page_size, device=device)[:T]
    slots[-1] = -1 if T > 1 else slots[-1]  # a padding token when there are two
    w = (1 + 0.1 * torch.randn(R, device=device)).to(dtype) if norm else None
    s = torch.tensor([scale], dtype=torch.float32, device=device)
    wide = nan_like((num_pages, page_size, R + P), dtype, device)
    cache = wide.to(FP8)
    Q, Q8 = nan_like((T, H, R + P), dtype, device), nan_like((T, H, R + P), dtype, device)
    absorb_q_rope_store_kv(q, w_kc, cos, sin, Q, wide, slots, kv_a[:, :R], kv_a[:, R:], w, 1e-6)
    absorb_q_rope_store_kv(q, w_kc, cos, sin, Q8, cache, slots, kv_a[:, :R], kv_a[:, R:], w, 1e-6, kv_scale=s)
    assert torch.equal(Q8, Q) and not Q.isnan().any(), "Q moved with the cache's dtype"
    ok = slots[slots >= 0]
    flat, wflat = cache.view(-1, R + P), wide.view(-1, R + P)
    assert torch.equal(bits(flat[ok]), bits(quantize_kv(wflat[ok], s))), f"fused fp8 store T={T} norm={norm} {dtype}"
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=device)
    written[ok] = True
    assert torch.isnan(flat[~written].float()).all(), "the fused fp8 store wrote a slot it should have skipped"


def check_mla_decode_fp8(
    device, dtype, *, ctx_lens: list[int], H: int, R: int, P: int, page_size: int, q_len: int, scale, config=None, **kw
):
    """mla_decode over an e4m3 cache, close to the fp32 torch reference over dequantize_kv's rows; with the scale 1.0
    also equal to mla_decode over those rows in dtype (the kernel converts each tile in registers to the same
    values): bit for bit in the interpreter; on the GPU, where the two are different compiled variants, within one
    ulp of the output plus one rounding of the probabilities over V's scale.
    Another scale multiplies the scores and output instead, skipping the rows' rounding to dtype.
    Every row outside the contexts holds NaN, the partial buffers are NaN-poisoned."""
    from mlaserve.attention.kv_fp8 import dequantize_kv, quantize_kv
    from mlaserve.kernels.mla_decode import mla_decode
    from tests.helpers.kernel_checks import assert_close, poisoned_empty
    from tests.helpers.kernel_refs import mla_decode_ref

    B, D = len(ctx_lens), R + P
    wide, table, seq_lens = make_paged(ctx_lens, page_size, D, torch.float32, device)
    used = torch.zeros(wide.shape[0] * page_size, dtype=torch.bool, device=device)
    for b, L in enumerate(ctx_lens):
        pos = torch.arange(L, device=device)
        used[table[b, pos // page_size].long() * page_size + pos % page_size] = True
    wide.view(-1, D)[~used] = float("nan")
    s = torch.tensor([scale], dtype=torch.float32, device=device)
    cache = quantize_kv(3 * wide, s)  # NaN stays NaN (e4m3fn's 0x7f)
    deq = dequantize_kv(cache, s, dtype)
    q = (0.3 * torch.randn(B * q_len, H, D, device=device)).to(dtype)
    sm = D**-0.5
    out, same = nan_like((B * q_len, H, R), dtype, device), nan_like((B * q_len, H, R), dtype, device)
    with poisoned_empty():
        mla_decode(q, cache, table, seq_lens, q_len, sm, out, kv_scale=s, config=config, **kw)
        mla_decode(q, deq, table, seq_lens, q_len, sm, same, config=config, **kw)  # the same load path
    if scale == 1.0 and not out.is_cuda:
        assert torch.equal(out, same), f"fp8 decode differs from the decode of the dequantized cache {ctx_lens} {dtype}"
    elif scale == 1.0:  # two compiled variants, rounding differently: one ulp of the output, plus one rounding of
        # the probabilities (cast to the dot's dtype before P @ V) over V's scale, which a near-zero output shows
        diff, mag = (out.float() - same.float()).abs(), torch.maximum(out.float().abs(), same.float().abs())
        eps, vmax = torch.finfo(dtype).eps, deq.float().nan_to_num(0.0).abs().amax()
        over = diff > eps * (mag + vmax)
        assert not bool(over.any()), (
            f"fp8 decode vs the dequantized cache's {ctx_lens} {dtype}: {int(over.sum())} values beyond "
            f"eps*(|out| + max|V|); {int((diff > eps * mag).sum())} of {diff.numel()} beyond 1 ulp; "
            f"max diff {float(diff.max()):.3g}, max|V| {float(vmax):.3g}"
        )
    ref = mla_decode_ref(q, deq.nan_to_num(0.0), table, seq_lens, q_len, sm, R)
    return assert_close(out, ref, dtype, f"fp8 mla_decode ctx={ctx_lens} H={H} q_len={q_len} {dtype}")
