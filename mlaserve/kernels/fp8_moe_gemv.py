"""The FP8 MoE of a 1-2 token decode step as grouped GEMVs (W8A16): fp8 expert rows streamed whole.

moe_gemv.py's design with fp8_gemv.py's tile: each program owns BLOCK_N rows of one (token, k) pair's expert and
streams them in trips of BLOCK_K columns as [BLOCK_K/8, BLOCK_N, 8] fp8 tiles: a thread holds 8 contiguous columns
of every row, sums them in fp32 against the matching 8 activations, scales that partial sum by its 128x128 block's
weight_scale_inv and accumulates; the threads' sums meet once, after the last trip. Two trips are loaded per loop
step before either is used. x and the intermediate stay bf16 (no activation quantization).

gemv1: Hbuf[p, n] = silu(x[tok] . gate_e[n]) * (x[tok] . up_e[n]), gate row n scaled by w13_scale_inv row n // 128
and up row n by row ceil(I/128) + n // 128 (the split layout of fp8_reference). gemv2: Y[p, d] = topk_weight[p] *
(Hbuf[p] . down_e[d]). Pairs whose expert another rank owns (EP) write nothing. PDL as moe_gemv.py: gemv1 waits
for the routing, then releases gemv2, which reads the routing and loads its first weight trips before its own wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8_gemv import VEC, chunk_dot, weight_trip
from .fp8_reference import BLOCK
from .pdl import pdl_release, pdl_wait


@triton.jit
def _tile_ptrs(
    W,
    S,
    e,
    rows,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    GROUP: tl.constexpr,
    C: tl.constexpr,
    VEC: tl.constexpr,
):
    """Pointers of expert e's `rows` as [C, R, VEC] weight tiles of a trip from column 0, and [C, R] to their
    scales (scale row row // GROUP), plus the trip's columns [C, VEC] and chunks [C]."""
    c = tl.arange(0, C)
    kk = c[:, None] * VEC + tl.arange(0, VEC)[None, :]
    w_ptr = W + e * stride_we + rows.to(tl.int64)[None, :, None] * stride_wn + kk[:, None, :]
    s_ptr = S + e * stride_se + (rows // GROUP).to(tl.int64)[None, :] * stride_sn
    s_ptr = s_ptr + (c // (GROUP // VEC))[:, None] * stride_sk
    return w_ptr, s_ptr, kk, c


@triton.jit
def _gate_up(g, sg, u, su, x_row, xk, D, acc_g, acc_u, EVEN: tl.constexpr):
    """One trip of the gate and up tiles against x's columns xk [C, VEC] (x loaded once for both)."""
    if EVEN:
        x = tl.load(x_row + xk)
    else:
        x = tl.load(x_row + xk, mask=xk < D, other=0.0)
    xf = x.to(tl.float32)[:, None, :]
    acc_g += tl.sum(g.to(tl.float32) * xf, 2) * sg
    acc_u += tl.sum(u.to(tl.float32) * xf, 2) * su
    return acc_g, acc_u


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
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    VEC: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    C: tl.constexpr = BLOCK_K // VEC
    nb = tl.cdiv(I, BLOCK_N)
    p = tl.program_id(0) // nb
    n = (tl.program_id(0) % nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    pdl_wait(PDL)
    pdl_release(PDL)  # only now: gemv2 reads the routing before its own wait
    e = tl.load(TopkIds + p).to(tl.int64) - expert_offset
    if (e < 0) | (e >= E_LOCAL):  # another rank's expert (EP): no row of this pair here
        return
    x_row = X + (p // TOPK) * stride_xt
    g_ptr, sg_ptr, kk, c = _tile_ptrs(
        W13, S13, e, n, stride_we, stride_wn, stride_se, stride_sn, stride_sk, GROUP, C, VEC
    )
    u_ptr = g_ptr + I * stride_wn
    su_ptr = sg_ptr + tl.cdiv(I, GROUP) * stride_sn
    acc_g = tl.zeros([C, BLOCK_N], tl.float32)
    acc_u = tl.zeros([C, BLOCK_N], tl.float32)
    D2 = D // (2 * BLOCK_K) * (2 * BLOCK_K)
    for k0 in range(0, D2, 2 * BLOCK_K):  # two trips a step, all four tiles in flight before any is used
        ga, sga = weight_trip(g_ptr, sg_ptr, k0, D, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        ua, sua = weight_trip(u_ptr, su_ptr, k0, D, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        gb, sgb = weight_trip(g_ptr, sg_ptr, k0 + BLOCK_K, D, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        ub, sub = weight_trip(u_ptr, su_ptr, k0 + BLOCK_K, D, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        acc_g, acc_u = _gate_up(ga, sga, ua, sua, x_row, k0 + kk, D, acc_g, acc_u, EVEN)
        acc_g, acc_u = _gate_up(gb, sgb, ub, sub, x_row, k0 + BLOCK_K + kk, D, acc_g, acc_u, EVEN)
    if D2 < D:  # the last one or two trips
        gc, sgc = weight_trip(g_ptr, sg_ptr, D2, D, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        uc, suc = weight_trip(u_ptr, su_ptr, D2, D, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        if D2 + BLOCK_K < D:
            gd, sgd = weight_trip(g_ptr, sg_ptr, D2 + BLOCK_K, D, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
            ud, sud = weight_trip(u_ptr, su_ptr, D2 + BLOCK_K, D, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        else:
            gd, sgd, ud, sud = gc, sgc, uc, suc  # unused
        acc_g, acc_u = _gate_up(gc, sgc, uc, suc, x_row, D2 + kk, D, acc_g, acc_u, EVEN)
        if D2 + BLOCK_K < D:
            acc_g, acc_u = _gate_up(gd, sgd, ud, sud, x_row, D2 + BLOCK_K + kk, D, acc_g, acc_u, EVEN)
    g = tl.sum(acc_g, 0)
    h = g * tl.sigmoid(g) * tl.sum(acc_u, 0)
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
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    VEC: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_release(PDL)
    C: tl.constexpr = BLOCK_K // VEC
    nb = tl.cdiv(D, BLOCK_N)
    p = tl.program_id(0) // nb
    d = (tl.program_id(0) % nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    d_ok = d < D
    # before the wait: the routing (complete when gemv1 released this kernel; through L2) and the first two trips
    e = tl.load(TopkIds + p, cache_modifier=".cg").to(tl.int64) - expert_offset
    if (e < 0) | (e >= E_LOCAL):
        return
    w_ptr, s_ptr, kk, c = _tile_ptrs(W2, S2, e, d, stride_we, stride_wn, stride_se, stride_sn, stride_sk, GROUP, C, VEC)
    wa, sa = weight_trip(w_ptr, s_ptr, 0, I, d_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
    if BLOCK_K < I:
        wb, sb = weight_trip(w_ptr, s_ptr, BLOCK_K, I, d_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
    else:
        wb, sb = wa, sa  # unused
    tw = tl.load(TopkW + p, cache_modifier=".cg")
    h_row = Hbuf + p * stride_hm
    pdl_wait(PDL)  # Hbuf is gemv1's
    acc = chunk_dot(wa.to(tl.float32), h_row, kk, kk < I, EVEN) * sa
    if BLOCK_K < I:
        acc += chunk_dot(wb.to(tl.float32), h_row, BLOCK_K + kk, BLOCK_K + kk < I, EVEN) * sb
    I2 = I // (2 * BLOCK_K) * (2 * BLOCK_K)
    for k0 in range(2 * BLOCK_K, I2, 2 * BLOCK_K):  # then two trips a step (new names: nothing loop-carried)
        wc, sc = weight_trip(w_ptr, s_ptr, k0, I, d_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        wd, sd = weight_trip(w_ptr, s_ptr, k0 + BLOCK_K, I, d_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        acc += chunk_dot(wc.to(tl.float32), h_row, k0 + kk, k0 + kk < I, EVEN) * sc
        acc += chunk_dot(wd.to(tl.float32), h_row, k0 + BLOCK_K + kk, k0 + BLOCK_K + kk < I, EVEN) * sd
    k1 = tl.maximum(I2, 2 * BLOCK_K)
    if k1 < I:  # the last one or two trips
        we, se = weight_trip(w_ptr, s_ptr, k1, I, d_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        if k1 + BLOCK_K < I:
            wf, sf = weight_trip(w_ptr, s_ptr, k1 + BLOCK_K, I, d_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        else:
            wf, sf = we, se  # unused
        acc += chunk_dot(we.to(tl.float32), h_row, k1 + kk, k1 + kk < I, EVEN) * se
        if k1 + BLOCK_K < I:
            acc += chunk_dot(wf.to(tl.float32), h_row, k1 + BLOCK_K + kk, k1 + BLOCK_K + kk < I, EVEN) * sf
    tl.store(Y + p * stride_yt + d, (tl.sum(acc, 0) * tw).to(Y.dtype.element_ty), mask=d_ok)


def _trip(n: int) -> int:
    """The largest power of 2 up to 1024 columns that divides n (no masks), else one masked trip size."""
    bk = 1024
    while bk > BLOCK and n % bk:
        bk //= 2
    return bk if n % bk == 0 else min(1024, max(triton.next_power_of_2(n), BLOCK))


def fp8_moe_gemv_config(D: int, I: int) -> dict:
    """Four rows a program (gate and up: eight row streams), trips of up to 1024 columns on 4 warps (one 8-byte chunk
    a row a thread): DeepSeek-V3's D = 7168 in seven trips, I = 2048 in two. kernels_bench --only fp8_moe sweeps
    both GEMVs' rows, trips and warps."""

    def cfg(n):
        bk = _trip(n)
        return dict(BLOCK_N=4, BLOCK_K=bk, num_warps=max(1, min(4, bk // (VEC * 32))))

    return dict(gemv1=cfg(D), gemv2=cfg(I))


def fp8_moe_gemv(x, w13, s13, w2, s2, topk_weights, topk_ids, expert_offset, hbuf, y, pdl, config=None):
    """fp8_fused_experts' two GEMMs as GEMVs, into hbuf [TK, I] and y [TK, D] (the caller checked every shape).
    config: {"gemv1": {...}, "gemv2": {...}} tile overrides (BLOCK_N a power of 2, BLOCK_K a power of 2 >= 128,
    num_warps)."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    TOPK = topk_ids.shape[-1]
    cfg = fp8_moe_gemv_config(D, I)
    for key, val in (config or {}).items():
        if key not in cfg or any(k not in cfg[key] for k in val):
            raise ValueError(f"fp8 moe gemv config {key}={val}: keys are gemv1 / gemv2 with {list(cfg['gemv1'])}")
        cfg[key] = dict(cfg[key], **val)
    c1, c2 = cfg["gemv1"], cfg["gemv2"]
    for c in (c1, c2):
        bk, bn = c["BLOCK_K"], c["BLOCK_N"]
        if bk < BLOCK or bk & (bk - 1) or bn & (bn - 1):
            raise ValueError(f"fp8 moe gemv BLOCK_K={bk} must be a power of 2 >= {BLOCK}, BLOCK_N={bn} a power of 2")
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
        BLOCK_K=c1["BLOCK_K"],
        GROUP=BLOCK,
        VEC=VEC,
        EVEN=I % c1["BLOCK_N"] == 0 and D % c1["BLOCK_K"] == 0,
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
        BLOCK_K=c2["BLOCK_K"],
        GROUP=BLOCK,
        VEC=VEC,
        EVEN=D % c2["BLOCK_N"] == 0 and I % c2["BLOCK_K"] == 0,
        num_warps=c2["num_warps"],
        **pdl,
    )
