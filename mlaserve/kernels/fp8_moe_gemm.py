"""The grouped tiled GEMMs of the FP8 MoE (fp8_moe.py): fused_moe.py's GEMM1 / GEMM2 over moe_align's per-expert
blocks, with fp8_gemm.py's scaled K steps (one 128-column scale block a step, scaled in fp32 outside the MMA).

A16: a is bf16/fp16/fp32 (x, then h), the fp8 weight tile widened in registers. A8: a is e4m3 with per-row, per-128
scales (x by fp8_quant.py; h by GEMM1's epilogue, whose BLOCK_N is one group); fp8 x fp8 MMAs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8_gemm import scaled_step
from .fp8_quant import quant_group
from .fused_moe import _block_rows, _pid_to_tile, _skip_block
from .pdl import pdl_start


@triton.jit
def _gemm1_tma_a8(
    AD,
    WD,
    as_ptr,
    sg_ptr,
    su_ptr,
    r0,
    rg,
    I,
    D,
    acc_g,
    acc_u,
    stride_asg,
    stride_sk,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    """GEMM1's W8A8 K loop over TMA tiles: a rows r0.. of the sorted x, gate rows rg.. and up rows rg + I.. of w13
    (the K tail past D reads zeros); as_ptr [M] the rows' scales, sg_ptr / su_ptr the tile's one gate / up scale
    (K group 0)."""
    # the next K step's scales load after this step's MMAs are issued: a load beside its own step's MMAs stalls
    # their scaling, and one issued before them holds back their issue
    a_s_n = tl.load(as_ptr)
    gs_n = tl.load(sg_ptr)
    us_n = tl.load(su_ptr)
    for k0 in range(0, D, BLOCK_K):
        a = AD.load([r0, k0])  # [M, K]
        g = WD.load([rg, k0])  # [N, K]
        u = WD.load([rg + I, k0])
        acc_g += tl.dot(a, tl.trans(g)) * (a_s_n[:, None] * gs_n)  # scaled_step's A8 step, one weight scale
        acc_u += tl.dot(a, tl.trans(u)) * (a_s_n[:, None] * us_n)
        kn = tl.minimum(k0 + BLOCK_K, D - 1) // GROUP  # the last step reloads its own group
        a_s_n = tl.load(as_ptr + kn * stride_asg)
        gs_n = tl.load(sg_ptr + kn * stride_sk)
        us_n = tl.load(su_ptr + kn * stride_sk)
    return acc_g, acc_u


@triton.jit
def _gemm2_tma_a8(
    AD,
    WD,
    as_ptr,
    ws_ptr,
    r0,
    rw,
    I,
    acc,
    stride_sk,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    """GEMM2's W8A8 K loop over TMA tiles: h rows r0.., down rows rw.. of w2 (the K tail past I reads zeros); as_ptr
    [M] the rows' scales, ws_ptr the tile's one weight scale (K group 0)."""
    a_s_n = tl.load(as_ptr)  # the next step's scales load as in _gemm1_tma_a8
    w_s_n = tl.load(ws_ptr)
    for k0 in range(0, I, BLOCK_K):
        a = AD.load([r0, k0])  # [M, K]
        w = WD.load([rw, k0])  # [N, K]
        acc += tl.dot(a, tl.trans(w)) * (a_s_n[:, None] * w_s_n)
        kn = tl.minimum(k0 + BLOCK_K, I - 1) // GROUP
        a_s_n = tl.load(as_ptr + kn)
        w_s_n = tl.load(ws_ptr + kn * stride_sk)
    return acc


@triton.jit(do_not_specialize=["num_m", "TK", "expert_offset"])
def _fp8_moe_gemm1_kernel(
    A,
    AS,
    W13,
    S13,
    H,
    HS,
    SortedIds,
    ExpertIds,
    NumPadded,
    TopkIds,
    AD,
    WD,
    I,
    D,
    num_m,
    stride_am,
    stride_asm,
    stride_asg,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_hm,
    stride_hsm,
    TK,
    expert_offset,
    E_LOCAL,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A8: tl.constexpr,
    NO_ALIGN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    GROUP: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr,
    H16: tl.constexpr = False,
):
    """H[m, n] = silu(a[tok] . gate_e[n]) * (a[tok] . up_e[n]) for the padded row m of expert e's block. A8: a is
    x's e4m3 with scales AS [T, G]; H gets h's e4m3 and HS [rows, ceil(I/128)] its scales (BLOCK_N == GROUP, so
    this program's columns are one group), or with H16 h itself in H's dtype (any BLOCK_N; quantized after). TMA
    (A8, I % BLOCK_N == 0): a is x already in the blocks' row order (act_quant's `sorted_ids`: row m is a[sorted
    pair m], padding rows 0) read by AD [rows, D] tiles with its scales AS [rows, G] by row m, and the weights by
    WD (w13 as [E * 2I, D]) tiles."""
    pdl_start(PDL)
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if _skip_block(pid_m, NumPadded, TopkIds, expert_offset, E_LOCAL, BLOCK_M, NO_ALIGN):
        return
    e, ids, offs_m, store = _block_rows(pid_m, SortedIds, ExpertIds, TopkIds, expert_offset, TK, BLOCK_M, NO_ALIGN)
    row_ok = ids < TK
    tok = (ids // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = A + tok[:, None] * stride_am + offs_k[None, :]
    g_ptr = W13 + e * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [K, N] view
    u_ptr = g_ptr + I * stride_wn
    sg_ptr = S13 + e * stride_se + (offs_n // GROUP) * stride_sn
    su_ptr = S13 + e * stride_se + (tl.cdiv(I, GROUP) + offs_n // GROUP) * stride_sn
    as_ptr = AS + tok * stride_asm
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if TMA:
        sg0 = S13 + e * stride_se + (pid_n * BLOCK_N // GROUP) * stride_sn  # BLOCK_N divides a group: one scale
        acc_g, acc_u = _gemm1_tma_a8(
            AD,
            WD,
            AS + offs_m * stride_asm,
            sg0,
            sg0 + tl.cdiv(I, GROUP) * stride_sn,
            pid_m * BLOCK_M,
            (e * 2 * I + pid_n * BLOCK_N).to(tl.int32),
            I,
            D,
            acc_g,
            acc_u,
            stride_asg,
            stride_sk,
            BLOCK_K,
            GROUP,
        )
    else:
        for k0 in range(0, D, BLOCK_K):
            k_ok = offs_k < D - k0
            a = tl.load(a_ptr + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            kg = (k0 // GROUP) * stride_sk
            gs = tl.load(sg_ptr + kg, mask=n_ok, other=0.0)
            us = tl.load(su_ptr + kg, mask=n_ok, other=0.0)
            a_s = gs  # A16: unused
            if A8:
                a_s = tl.load(as_ptr + (k0 // GROUP) * stride_asg, mask=row_ok, other=0.0)
            acc_g = scaled_step(acc_g, a, g, a_s, gs, A8, DOT_PREC)
            acc_u = scaled_step(acc_u, a, u, a_s, us, A8, DOT_PREC)
    h = acc_g * tl.sigmoid(acc_g) * acc_u  # masked columns: 0
    h_ptr = H + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
    if A8 and not H16:
        q, s = quant_group(h)
        tl.store(h_ptr, q, mask=store[:, None] & n_ok[None, :])
        tl.store(HS + offs_m.to(tl.int64) * stride_hsm + pid_n, s, mask=store)
    else:
        tl.store(h_ptr, h.to(H.dtype.element_ty), mask=store[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_m", "TK", "expert_offset"])
def _fp8_moe_gemm2_kernel(
    H,
    HS,
    W2,
    S2,
    Y,
    SortedIds,
    ExpertIds,
    NumPadded,
    TopkW,
    TopkIds,
    AD,
    WD,
    D,
    I,
    num_m,
    stride_hm,
    stride_hsm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_yt,
    TK,
    expert_offset,
    E_LOCAL,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A8: tl.constexpr,
    NO_ALIGN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    GROUP: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    """Y[(t, k)] = topk_weight[t, k] * (H[m] . down_e) for every real row m of expert e's blocks (A8: H e4m3 with
    scales HS). TMA (A8): H by AD [rows, I] tiles, the weights by WD (w2 as [E * D, I]) tiles."""
    pdl_start(PDL)
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), num_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    if _skip_block(pid_m, NumPadded, TopkIds, expert_offset, E_LOCAL, BLOCK_M, NO_ALIGN):
        return
    e, ids, offs_m, _ = _block_rows(pid_m, SortedIds, ExpertIds, TopkIds, expert_offset, TK, BLOCK_M, NO_ALIGN)
    row_ok = ids < TK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = H + offs_m.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]
    w_ptr = W2 + e * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [K, N] view
    ws_ptr = S2 + e * stride_se + (offs_n // GROUP) * stride_sn
    as_ptr = HS + offs_m.to(tl.int64) * stride_hsm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if TMA:
        acc = _gemm2_tma_a8(
            AD,
            WD,
            as_ptr,
            S2 + e * stride_se + (pid_n * BLOCK_N // GROUP) * stride_sn,  # BLOCK_N divides a group: one scale
            pid_m * BLOCK_M,
            (e * D + pid_n * BLOCK_N).to(tl.int32),
            I,
            acc,
            stride_sk,
            BLOCK_K,
            GROUP,
        )
    else:
        for k0 in range(0, I, BLOCK_K):
            k_ok = offs_k < I - k0
            a = tl.load(a_ptr + k0, mask=k_ok[None, :], other=0.0)  # padding rows hold zeros (GEMM1 wrote them)
            w = tl.load(w_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            w_s = tl.load(ws_ptr + (k0 // GROUP) * stride_sk, mask=n_ok, other=0.0)
            a_s = w_s  # A16: unused
            if A8:
                a_s = tl.load(as_ptr + k0 // GROUP)
            acc = scaled_step(acc, a, w, a_s, w_s, A8, DOT_PREC)
    w = tl.load(TopkW + ids, mask=row_ok, other=0.0)
    y_ptr = Y + ids.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptr, (acc * w[:, None]).to(Y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
