"""The INT4 MoE's two GEMVs on the tensor cores (the dot itself: int4_mma.py), and the check that the compiled
kernels place the tiles as that dot assumes.

gemv1: program (pair p, gate rows n0 .. n0 + 8 MR) -> Hbuf[p, n] = silu(gate . x) * (up . x), each 8 columns
stored as pairs (j, j + 4). gemv2: program (pair p, rows d0 .. d0 + 16 MR) -> Y[p, d] = topk_weight[p] * (down . H).
A program of WG warps walks K in trips of 4 WG groups (128 WG columns), each warp on 4 groups of every row. (Warps
on rows too would narrow the loads of x, a [1, 128 WG] tile, below 16 bytes a lane, and so change its layout.)
Pairs of experts outside [offset, offset + E) exit at once. Two pairs of one expert (a step of several tokens) are
done by the first one's programs as tokens A and B (int4_mma.py), so the expert is read once for both (_partner).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .int4_gemv import _pair
from .int4_mma import _lanes, _mma, _mma_dot, _row_sums, _trip_w, _trip_x
from .pdl import pdl_release, pdl_wait


@triton.jit
def _partner(p, TopkIds, TK, TKP: tl.constexpr, CG: tl.constexpr):
    """(skip, q, has_q) for pair p: the pairs of one expert are done two at a time, the first pair's programs
    taking the second (q) as token B; the second pair's programs skip; a third pair of the expert runs alone.
    TK pairs, TKP a power of 2 >= TK (0: no pairing). CG: read the routing through L2 (before a PDL wait)."""
    skip = p < 0  # false (as a tensor)
    q = p
    has_q = p < 0
    if TKP > 0:
        i = tl.arange(0, TKP)
        if CG:
            ids = tl.load(TopkIds + i, mask=i < TK, other=-1, cache_modifier=".cg")
            e = tl.load(TopkIds + p, cache_modifier=".cg")
        else:
            ids = tl.load(TopkIds + i, mask=i < TK, other=-1)
            e = tl.load(TopkIds + p)
        same = ids == e
        lead = tl.min(tl.where(same, i, TKP))
        second = tl.min(tl.where(same & (i > lead), i, TKP))
        has_q = (lead == p) & (second < TKP)
        skip = (lead != p) & (second == p)
        q = tl.where(has_q, second, p)
    return skip, q, has_q


@triton.jit(do_not_specialize=["expert_offset", "TK"])
def _int4_mma_gemv1_kernel(
    X32,
    W13,
    S13,
    Hbuf,
    TopkIds,
    I,
    NG,
    TK,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn4,
    stride_hm,
    expert_offset,
    E_LOCAL,
    TOPK: tl.constexpr,
    TKP: tl.constexpr,
    MR: tl.constexpr,
    WG: tl.constexpr,
    EVEN: tl.constexpr,
    PREFETCH: tl.constexpr,
    MUL: tl.constexpr,
    NS: tl.constexpr,
    PDL: tl.constexpr,
    NGC: tl.constexpr,
):
    """Hbuf[p, n] (and Hbuf[q, n] for a pair q of the same expert, _partner) for the 8 MR gate rows n of the
    program's block (top rows) and their up rows I + n (bottom rows). NGC > 0: K's trips unrolled (_mma_dot)."""
    pdl_wait(PDL)
    pdl_release(PDL)  # only now: gemv2 reads the routing before its own wait (pdl.py)
    ROWS: tl.constexpr = 8 * MR
    nb = tl.cdiv(I, ROWS)
    p = tl.program_id(0) // nb
    e, own = _pair(p, TopkIds, expert_offset, E_LOCAL, False)
    if not own:
        return
    skip, q, has_q = _partner(p, TopkIds, TK, TKP, False)
    if skip:
        return
    n0 = (tl.program_id(0) % nb) * ROWS
    m = tl.arange(0, MR)[:, None]
    n = n0 + 8 * m + (tl.arange(0, 128 * WG)[None, :] // 16) % 8  # [MR, V]: each lane's gate row
    W, S = W13 + e * stride_we, S13 + e * stride_se  # expert e; rows as int32 offsets (fewer registers)
    Wb, Sb = W + I * stride_wn, S + I * (4 * stride_sn4)
    xa = X32 + (p // TOPK).to(tl.int64) * stride_xt
    xb = X32 + (q // TOPK).to(tl.int64) * stride_xt
    wrow, srow = n * stride_wn, n * (4 * stride_sn4)
    acc = _mma_dot(
        W, Wb, S, Sb, wrow, srow, n < I, n < I, xa, xb, has_q, NG, MR, WG, EVEN, False, PREFETCH, False, MUL, NS, NGC
    )
    gate, up = tl.split(_row_sums(acc, MR, WG))  # [MR, 8, 2]: tokens A, B
    h_a, h_b = tl.split(gate * tl.sigmoid(gate) * up)
    g = tl.arange(0, 8)[None, :]
    col = n0 + 8 * m + g
    pos = n0 + 8 * m + 2 * (g % 4) + g // 4  # column 8 i + j at 8 i + 2 (j % 4) + j // 4: pairs (j, j + 4)
    tl.store(Hbuf + p * stride_hm + pos, h_a.to(Hbuf.dtype.element_ty), mask=col < I)
    tl.store(Hbuf + q * stride_hm + pos, h_b.to(Hbuf.dtype.element_ty), mask=(col < I) & has_q)


@triton.jit
def _store_rows(acc, Ya, Yb, has_b, r0, tw_a, tw_b, D, MR: tl.constexpr, WG: tl.constexpr):
    """Ya[r0 + r] = tw_a * (row r's sum for token A), and Yb's for token B (if has_b), for the block's 16 MR rows
    (top: the first 8 MR)."""
    top, bot = tl.split(_row_sums(acc, MR, WG))  # [MR, 8, 2]: tokens A, B
    top_a, top_b = tl.split(top)
    bot_a, bot_b = tl.split(bot)
    rt = r0 + 8 * tl.arange(0, MR)[:, None] + tl.arange(0, 8)[None, :]
    rb = rt + 8 * MR
    tl.store(Ya + rt, (top_a * tw_a).to(Ya.dtype.element_ty), mask=rt < D)
    tl.store(Ya + rb, (bot_a * tw_a).to(Ya.dtype.element_ty), mask=rb < D)
    tl.store(Yb + rt, (top_b * tw_b).to(Yb.dtype.element_ty), mask=(rt < D) & has_b)
    tl.store(Yb + rb, (bot_b * tw_b).to(Yb.dtype.element_ty), mask=(rb < D) & has_b)


@triton.jit
def _gemv2_blocks(
    H32,
    W,
    S,
    Y,
    TopkW,
    p,
    q,
    has_q,
    c,
    D,
    NG,
    stride_hm,
    stride_wn,
    stride_sn4,
    stride_yt,
    MR: tl.constexpr,
    WG: tl.constexpr,
    NB: tl.constexpr,
    EVEN: tl.constexpr,
    PREFETCH: tl.constexpr,
    MUL: tl.constexpr,
    NS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Y rows of pair p (and q) for the NB blocks of chunk c."""
    ROWS: tl.constexpr = 16 * MR
    d0 = c * (NB * ROWS)
    m = tl.arange(0, MR)[:, None]
    dl = 8 * m + (tl.arange(0, 128 * WG)[None, :] // 16) % 8  # [MR, V]: each lane's top row in a block
    Wb, Sb = W + 8 * MR * stride_wn, S + 8 * MR * (4 * stride_sn4)
    tw_a = tl.load(TopkW + p, cache_modifier=".cg")
    tw_b = tl.load(TopkW + q, cache_modifier=".cg")
    ha, hb = H32 + p.to(tl.int64) * stride_hm, H32 + q.to(tl.int64) * stride_hm
    ya, yb = Y + p * stride_yt, Y + q * stride_yt
    d = d0 + dl
    wrow, srow = d * stride_wn, d * (4 * stride_sn4)
    t_ok, b_ok = d < D, d + 8 * MR < D
    if NB == 1:
        acc = _mma_dot(
            W, Wb, S, Sb, wrow, srow, t_ok, b_ok, ha, hb, has_q, NG, MR, WG, EVEN, True, PREFETCH, PDL, MUL, NS
        )
        _store_rows(acc, ya, yb, has_q, d0, tw_a, tw_b, D, MR, WG)
    else:
        woff, sgrp, xoff, diag, diag_b, grp = _lanes(WG)
        wt, wb, st, sb = _trip_w(W, Wb, S, Sb, wrow, srow, t_ok, b_ok, 0, NG, woff, sgrp, grp, EVEN)
        pdl_wait(PDL)
        y0, y1, y2, y3, xs = _trip_x(ha, hb, has_q, 0, NG, xoff, diag, diag_b, grp, True)
        zero = tl.zeros([MR, 128 * WG], tl.float32)
        acc = _mma(wt, wb, st, sb, y0, y1, y2, y3, xs, zero, MUL)
        _store_rows(acc, ya, yb, has_q, d0, tw_a, tw_b, D, MR, WG)
        for r0 in tl.range(d0 + ROWS, tl.minimum(d0 + NB * ROWS, D), ROWS, num_stages=NS):
            d = r0 + dl
            wrow, srow = d * stride_wn, d * (4 * stride_sn4)
            wt, wb, st, sb = _trip_w(W, Wb, S, Sb, wrow, srow, d < D, d + 8 * MR < D, 0, NG, woff, sgrp, grp, EVEN)
            acc = _mma(wt, wb, st, sb, y0, y1, y2, y3, xs, zero, MUL)
            _store_rows(acc, ya, yb, has_q, r0, tw_a, tw_b, D, MR, WG)


@triton.jit(do_not_specialize=["expert_offset", "TK"])
def _int4_mma_gemv2_kernel(
    H32,
    W2,
    S2,
    Y,
    TopkW,
    TopkIds,
    D,
    NG,
    TK,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn4,
    stride_yt,
    expert_offset,
    E_LOCAL,
    TKP: tl.constexpr,
    MR: tl.constexpr,
    WG: tl.constexpr,
    NB: tl.constexpr,
    EVEN: tl.constexpr,
    PREFETCH: tl.constexpr,
    MUL: tl.constexpr,
    NS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Y[p, d] (and Y[q, d], _partner) for NB blocks of 16 MR rows d (top: a block's first 8 MR). The routing is
    read before the PDL wait through L2, and so are the first trip's weights (pdl.py): only Hbuf waits.
    NB > 1 (K in one trip, NG <= 4 WG): x is unpacked once, and the blocks' loads run NS - 1 blocks ahead."""
    pdl_release(PDL)
    ROWS: tl.constexpr = 16 * MR
    nprog = tl.cdiv(tl.cdiv(D, ROWS), NB)
    p = tl.program_id(0) // nprog
    c = tl.program_id(0) % nprog
    e, own = _pair(p, TopkIds, expert_offset, E_LOCAL, PDL)
    if not own:  # before the pairing scan: under EP most programs exit here
        return
    skip, q, has_q = _partner(p, TopkIds, TK, TKP, PDL)
    if skip:
        return
    W, S = W2 + e * stride_we, S2 + e * stride_se
    _gemv2_blocks(
        H32, W, S, Y, TopkW, p, q, has_q, c, D, NG, stride_hm, stride_wn, stride_sn4, stride_yt, MR, WG, NB, EVEN,
        PREFETCH, MUL, NS, PDL,
    )  # fmt: skip
