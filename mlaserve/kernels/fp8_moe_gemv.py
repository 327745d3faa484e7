"""The FP8 MoE of a 1-2 token decode step as grouped GEMVs (W8A16): fp8 expert rows streamed whole.

moe_gemv.py's design with fp8_gemv.py's tile: each program owns BLOCK_N rows of one (token, k) pair's expert and
loads them as [BLOCK_N, BLOCK_K/128, 128] fp8 tiles, so each 128-column block's partial sum meets its
weight_scale_inv entry in fp32; x and the intermediate stay bf16 (no activation quantization).

gemv1: Hbuf[p, n] = silu(x[tok] . gate_e[n]) * (x[tok] . up_e[n]), gate row n scaled by w13_scale_inv row n // 128
and up row n by row ceil(I/128) + n // 128 (the split layout of fp8_reference). gemv2: Y[p, d] = topk_weight[p] *
(Hbuf[p] . down_e[d]). Pairs whose expert another rank owns (EP) write nothing. PDL as moe_gemv.py: gemv1 waits
for the routing, then releases gemv2, which reads the routing and loads its first weight trip before its own wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8_gemv import block_dot
from .fp8_reference import BLOCK
from .pdl import pdl_release, pdl_wait


@triton.jit
def _w_trip(w_row, s_row, n_ok, k0, K, stride_sk, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """One K trip of BLOCK_N rows: (w [BLOCK_N, GROUPS, GROUP] fp8, scales [BLOCK_N, GROUPS], k [GROUPS, GROUP],
    k_ok). w_row / s_row: per-row pointers to the rows' first weight / their scale row."""
    g = tl.arange(0, GROUPS)
    k = k0 + g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    k_ok = k < K
    w = tl.load(w_row[:, None, None] + k[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0)
    gk = k0 // GROUP + g
    sc = tl.load(s_row[:, None] + gk[None, :] * stride_sk, mask=n_ok[:, None] & (gk * GROUP < K)[None, :], other=0.0)
    return w, sc, k, k_ok


@triton.jit(do_not_specialize=["T", "expert_offset"])
def _fp8_moe_gemv1_kernel(
    X,
    W13,
    S13,
    Hbuf,
    TopkIds,
    T,
    D,
    I,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_hm,
    expert_offset,
    E_LOCAL,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    nb = tl.cdiv(I, BLOCK_N)
    p = tl.program_id(0) // nb
    n = (tl.program_id(0) % nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    pdl_wait(PDL)
    pdl_release(PDL)  # only now: gemv2 reads the routing before its own wait
    e = tl.load(TopkIds + p).to(tl.int64) - expert_offset
    if (e < 0) | (e >= E_LOCAL):  # another rank's expert (EP): no row of this pair here
        return
    tok = p // TOPK
    g_row = W13 + e * stride_we + n.to(tl.int64) * stride_wn
    u_row = g_row + I * stride_wn
    sg_row = S13 + e * stride_se + (n // GROUP) * stride_sn
    su_row = S13 + e * stride_se + (tl.cdiv(I, GROUP) + n // GROUP) * stride_sn
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, D, GROUPS * GROUP):
        wg, sg, k, k_ok = _w_trip(g_row, sg_row, n_ok, k0, D, stride_sk, GROUPS, GROUP)
        wu, su, k, k_ok = _w_trip(u_row, su_row, n_ok, k0, D, stride_sk, GROUPS, GROUP)
        x = tl.load(X + tok * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
        acc_g += block_dot(wg, x, sg)
        acc_u += block_dot(wu, x, su)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(Hbuf + p * stride_hm + n, h.to(Hbuf.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["T", "expert_offset"])
def _fp8_moe_gemv2_kernel(
    Hbuf,
    W2,
    S2,
    Y,
    TopkW,
    TopkIds,
    T,
    D,
    I,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_yt,
    expert_offset,
    E_LOCAL,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_release(PDL)
    nb = tl.cdiv(D, BLOCK_N)
    p = tl.program_id(0) // nb
    d = (tl.program_id(0) % nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    d_ok = d < D
    # before the wait: the routing (complete when gemv1 released this kernel; through L2) and the first K trip
    e = tl.load(TopkIds + p, cache_modifier=".cg").to(tl.int64) - expert_offset
    if (e < 0) | (e >= E_LOCAL):
        return
    w_row = W2 + e * stride_we + d.to(tl.int64) * stride_wn
    s_row = S2 + e * stride_se + (d // GROUP) * stride_sn
    w, sc, k, k_ok = _w_trip(w_row, s_row, d_ok, 0, I, stride_sk, GROUPS, GROUP)
    tw = tl.load(TopkW + p, cache_modifier=".cg")
    pdl_wait(PDL)
    h = tl.load(Hbuf + p * stride_hm + k, mask=k_ok, other=0.0).to(tl.float32)
    acc = block_dot(w, h, sc)
    for k0 in range(GROUPS * GROUP, I, GROUPS * GROUP):
        w, sc, k, k_ok = _w_trip(w_row, s_row, d_ok, k0, I, stride_sk, GROUPS, GROUP)
        h = tl.load(Hbuf + p * stride_hm + k, mask=k_ok, other=0.0).to(tl.float32)
        acc += block_dot(w, h, sc)
    tl.store(Y + p * stride_yt + d, (acc * tw).to(Y.dtype.element_ty), mask=d_ok)


def fp8_moe_gemv_config(D: int, I: int) -> dict:
    """moe_gemv.py's rows per program and warps, with up to 4096 fp8 columns a trip (as many bytes a row in flight
    as its 2048 bf16 columns): DeepSeek-V3's D = 7168 in two trips, I = 2048 in one."""
    trip = lambda n: min(triton.next_power_of_2(max(n, BLOCK)), 4096)  # noqa: E731
    return dict(
        gemv1=dict(BLOCK_N=2, BLOCK_K=trip(D), num_warps=4),
        gemv2=dict(BLOCK_N=4, BLOCK_K=trip(I), num_warps=2),
    )


def fp8_moe_gemv(x, w13, s13, w2, s2, topk_weights, topk_ids, expert_offset, hbuf, y, pdl, config=None):
    """fp8_fused_experts' two GEMMs as GEMVs, into hbuf [TK, I] and y [TK, D] (the caller checked every shape).
    config: {"gemv1": {...}, "gemv2": {...}} tile overrides (BLOCK_N, BLOCK_K a power of 2 >= 128, num_warps)."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    TOPK = topk_ids.shape[-1]
    cfg = fp8_moe_gemv_config(D, I)
    for key, val in (config or {}).items():
        cfg[key] = dict(cfg[key], **val)
    c1, c2 = cfg["gemv1"], cfg["gemv2"]
    for c in (c1, c2):
        if c["BLOCK_K"] % BLOCK or c["BLOCK_K"] & (c["BLOCK_K"] - 1):
            raise ValueError(f"fp8 moe gemv BLOCK_K={c['BLOCK_K']} must be a power of 2 and a multiple of {BLOCK}")
    ids = topk_ids.reshape(-1)
    _fp8_moe_gemv1_kernel[(T * TOPK * triton.cdiv(I, c1["BLOCK_N"]),)](
        x,
        w13,
        s13,
        hbuf,
        ids,
        T,
        D,
        I,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        s13.stride(2),
        hbuf.stride(0),
        expert_offset,
        E,
        TOPK=TOPK,
        BLOCK_N=c1["BLOCK_N"],
        GROUPS=c1["BLOCK_K"] // BLOCK,
        GROUP=BLOCK,
        num_warps=c1["num_warps"],
        **pdl,
    )
    _fp8_moe_gemv2_kernel[(T * TOPK * triton.cdiv(D, c2["BLOCK_N"]),)](
        hbuf,
        w2,
        s2,
        y,
        topk_weights.reshape(-1),
        ids,
        T,
        D,
        I,
        hbuf.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        s2.stride(2),
        y.stride(0),
        expert_offset,
        E,
        BLOCK_N=c2["BLOCK_N"],
        GROUPS=c2["BLOCK_K"] // BLOCK,
        GROUP=BLOCK,
        num_warps=c2["num_warps"],
        **pdl,
    )
