"""The fused MoE of a 1-2 token decode step as grouped GEMVs: weight rows streamed whole by many small programs.

At <= no_align_max_pairs (token, k) pairs every pair is its own block (fused_moe.py) and the GEMMs are weight
streams: the tiled kernels give each program a [BLOCK_N, BLOCK_K] weight tile per K step (352 programs at batch 1 on
Moonlight, 2-3 per SM, one or two tiles in flight each). Here, as in gemv.py, each program owns BLOCK_N rows of one
pair's expert and loads their whole K extent at once (one trip for K <= BLOCK_K), so thousands of short programs
keep the loads in flight, read each DRAM row contiguously, and finish in a fine-grained tail.

gemv1: Hbuf[p, n] = silu(x[tok] . gate[e, n]) * (x[tok] . up[e, n]) for the pair p = (tok, k), e = its expert.
gemv2: Y[p, d] = topk_weight[p] * (Hbuf[p] . down[e, d]). The sums are fp32 (bf16 products are exact there); the
order differs from the tiled kernels' tl.dot, so the two forms agree to rounding, not bit for bit.

Shared slots (fused_moe.py): the routing appends them as the last S columns of each token's ids (routing.py). The
programs of those columns load their rows before the PDL wait (weights: pdl.py), guessing the slot from the column;
after the wait the id is checked and the rows reloaded if the guess was wrong. Programs are ordered shared pairs
first, so the ones resident early are the ones that can use the wait. gemv1 waits, then releases gemv2, so gemv2
may read the routing before its own wait, through L2, and load its rows there too (pdl.py's amendment).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_release, pdl_wait


@triton.jit
def _pair_of(q, T, TOPK: tl.constexpr, S: tl.constexpr):
    """Program rank q -> (pair index p, token, slot j of a shared column or -1): the T*S shared pairs first, then
    the T*(TOPK-S) routed ones."""
    KR: tl.constexpr = TOPK - S
    if q < T * S:
        tok = q // S
        j = q % S
        p = tok * TOPK + KR + j
    else:
        r = q - T * S
        tok = r // KR
        j = -1
        p = tok * TOPK + r % KR
    return p, tok, j


@triton.jit
def _program(N, T, TOPK: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's pair, token, guessed shared slot (_pair_of) and its BLOCK_N of the N output rows (+ mask)."""
    nb = tl.cdiv(N, BLOCK_N)
    p, tok, j = _pair_of(tl.program_id(0) // nb, T, TOPK, S)
    rows = (tl.program_id(0) % nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    return p, tok, j, rows, rows < N


@triton.jit
def _rows(W, WS, e, rows, stride_we, stride_wn, stride_sn, row0, col0, E_ROUTED, HAS_SHARED: tl.constexpr):
    """Pointers to the first element of each of `rows` of expert e's matrix: routed experts W[e, rows, :]; with
    HAS_SHARED, e >= E_ROUTED is slot j = e - E_ROUTED of WS: its rows j * row0 + rows from column j * col0 (gate and
    up: the slot's rows of [S*I, D]; down: the slot's columns of [D, S*I])."""
    ptr = W + e * stride_we + rows.to(tl.int64) * stride_wn
    if HAS_SHARED:
        j = tl.maximum(e - E_ROUTED, 0)
        ptr = tl.where(e >= E_ROUTED, WS + (j * row0 + rows).to(tl.int64) * stride_sn + j * col0, ptr)
    return ptr


@triton.jit(do_not_specialize=["T", "expert_offset"])
def _moe_gemv1_kernel(
    X,
    W13,
    W1S,
    W3S,
    Hbuf,
    TopkIds,
    T,
    D,
    I,
    stride_xt,
    stride_we,
    stride_wn,
    stride_sn,
    stride_hm,
    expert_offset,
    E_LOCAL,
    E_ROUTED,
    TOPK: tl.constexpr,
    S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    p, tok, j, n, n_ok = _program(I, T, TOPK, S, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    k_ok = k < D
    # before the wait: a shared column's slot rows (gate rows j*I + n of W1S, up rows of W3S), first K trip
    guess = j >= 0
    ok = (n_ok & guess)[:, None] & k_ok[None, :]
    rows_s = (tl.maximum(j, 0) * I + n).to(tl.int64) * stride_sn
    wg = tl.load(W1S + rows_s[:, None] + k[None, :], mask=ok, other=0.0)
    wu = tl.load(W3S + rows_s[:, None] + k[None, :], mask=ok, other=0.0)
    pdl_wait(PDL)
    pdl_release(PDL)  # only now: gemv2 reads the routing before its own wait
    e = tl.load(TopkIds + p).to(tl.int64) - expert_offset
    if (e < 0) | (e >= E_LOCAL):  # another rank's expert (EP): no row of this pair here
        return
    g_ptr = _rows(W13, W1S, e, n, stride_we, stride_wn, stride_sn, I, 0, E_ROUTED, S > 0)
    u_ptr = _rows(W13 + I * stride_wn, W3S, e, n, stride_we, stride_wn, stride_sn, I, 0, E_ROUTED, S > 0)
    ok = n_ok[:, None] & k_ok[None, :]
    if (j < 0) | (e != E_ROUTED + j):  # no guess, or a wrong one: the first trip now
        wg = tl.load(g_ptr[:, None] + k[None, :], mask=ok, other=0.0)
        wu = tl.load(u_ptr[:, None] + k[None, :], mask=ok, other=0.0)
    x = tl.load(X + tok * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
    acc_g = tl.sum(wg.to(tl.float32) * x[None, :], 1)
    acc_u = tl.sum(wu.to(tl.float32) * x[None, :], 1)
    for k0 in range(BLOCK_K, D, BLOCK_K):  # K > BLOCK_K (hidden 7168): the other trips
        kk = k0 + k
        ok = n_ok[:, None] & (kk < D)[None, :]
        x = tl.load(X + tok * stride_xt + kk, mask=kk < D, other=0.0).to(tl.float32)
        acc_g += tl.sum(tl.load(g_ptr[:, None] + kk[None, :], mask=ok, other=0.0).to(tl.float32) * x[None, :], 1)
        acc_u += tl.sum(tl.load(u_ptr[:, None] + kk[None, :], mask=ok, other=0.0).to(tl.float32) * x[None, :], 1)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(Hbuf + p * stride_hm + n, h.to(Hbuf.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["T", "expert_offset"])
def _moe_gemv2_kernel(
    Hbuf,
    W2,
    W2S,
    Y,
    TopkW,
    TopkIds,
    T,
    D,
    I,
    stride_hm,
    stride_we,
    stride_wn,
    stride_sn,
    stride_yt,
    expert_offset,
    E_LOCAL,
    E_ROUTED,
    TOPK: tl.constexpr,
    S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_release(PDL)
    p, tok, j, d, d_ok = _program(D, T, TOPK, S, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    k_ok = k < I
    # before the wait: the routing (complete when gemv1 released this kernel; through L2) and the first K trip
    e = tl.load(TopkIds + p, cache_modifier=".cg").to(tl.int64) - expert_offset
    if (e < 0) | (e >= E_LOCAL):
        return
    w_ptr = _rows(W2, W2S, e, d, stride_we, stride_wn, stride_sn, 0, I, E_ROUTED, S > 0)
    w = tl.load(w_ptr[:, None] + k[None, :], mask=d_ok[:, None] & k_ok[None, :], other=0.0)
    tw = tl.load(TopkW + p, cache_modifier=".cg")
    pdl_wait(PDL)
    h = tl.load(Hbuf + p * stride_hm + k, mask=k_ok, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * h[None, :], 1)
    for k0 in range(BLOCK_K, I, BLOCK_K):
        kk = k0 + k
        h = tl.load(Hbuf + p * stride_hm + kk, mask=kk < I, other=0.0).to(tl.float32)
        wk = tl.load(w_ptr[:, None] + kk[None, :], mask=d_ok[:, None] & (kk < I)[None, :], other=0.0)
        acc += tl.sum(wk.to(tl.float32) * h[None, :], 1)
    tl.store(Y + p * stride_yt + d, (acc * tw).to(Y.dtype.element_ty), mask=d_ok)


def moe_gemv_config(D: int, I: int) -> dict:
    """Rows per program and the K trip of each GEMV: gemv.py's two rows (gate and up: four) with the whole row in
    one trip up to 2048 columns (longer rows loop), 2-4 warps (splitting a 1408-wide trip to save registers was
    slower: docs/experiments.md)."""
    return dict(
        gemv1=dict(BLOCK_N=2, BLOCK_K=min(triton.next_power_of_2(D), 2048), num_warps=4),
        gemv2=dict(BLOCK_N=4, BLOCK_K=min(triton.next_power_of_2(I), 2048), num_warps=2),
    )


def moe_gemv(x, w13, w2, topk_weights, topk_ids, expert_offset, w1s, w3s, w2s, S, hbuf, y, pdl, config=None):
    """fused_experts' two GEMMs as GEMVs, into hbuf [TK, I] and y [TK, D] (its buffers; the caller checked every
    shape). w1s / w3s / w2s: the shared slots' weights (any tensor when S == 0). config: {"gemv1": {...}, "gemv2":
    {...}} tile overrides."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    TOPK = topk_ids.shape[-1]
    cfg = moe_gemv_config(D, I)
    for key, val in (config or {}).items():
        cfg[key] = dict(cfg[key], **val)
    c1, c2 = cfg["gemv1"], cfg["gemv2"]
    ids = topk_ids.reshape(-1)
    sn1 = w1s.stride(0) if S else 0
    _moe_gemv1_kernel[(T * TOPK * triton.cdiv(I, c1["BLOCK_N"]),)](
        x,
        w13,
        w1s,
        w3s,
        hbuf,
        ids,
        T,
        D,
        I,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        sn1,
        hbuf.stride(0),
        expert_offset,
        E + S,
        E,
        TOPK=TOPK,
        S=S,
        BLOCK_N=c1["BLOCK_N"],
        BLOCK_K=c1["BLOCK_K"],
        num_warps=c1["num_warps"],
        **pdl,
    )
    _moe_gemv2_kernel[(T * TOPK * triton.cdiv(D, c2["BLOCK_N"]),)](
        hbuf,
        w2,
        w2s,
        y,
        topk_weights.reshape(-1),
        ids,
        T,
        D,
        I,
        hbuf.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2s.stride(0) if S else 0,
        y.stride(0),
        expert_offset,
        E + S,
        E,
        TOPK=TOPK,
        S=S,
        BLOCK_N=c2["BLOCK_N"],
        BLOCK_K=c2["BLOCK_K"],
        num_warps=c2["num_warps"],
        **pdl,
    )
