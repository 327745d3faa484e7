"""The INT4 MoE of a one-token step on a MoE-TP shard (I <= 512) as ONE launch of tensor-core GEMVs (the dot:
int4_mma.py): both GEMVs, with no wait on the whole grid between them.

Program (pair p, slice j of NSL = I / 16): gemv1's block j (16 gate rows and their up rows -> H[p, 16 j .. + 16],
as int4_mma_gemv's gemv1 computes it), then, once all NSL programs of pair p have stored their slices, the down
rows j D / NSL .. + D / NSL of Y[p] = topk_weight[p] * (down . H[p]), whole rows in the checkpoint's layout. A
program waits only on its own pair's programs: a count per pair, raised with release semantics after the slice's
stores, spun on with acquire semantics (gpu scope); the first trip of down words is loaded before the spin, and H
after it through L2. The last program past the spin resets the pair's counts, so the buffer is zero between calls.

Why: in two launches gemv2 starts only when the whole of gemv1 has finished, and each launch ramps up and drains on
its own; a shard's bytes (49.5 MB at Kimi-K2.5's MoE-TP4) are too few to hide that. In one launch a pair's down
rows stream while other pairs still run gemv1 (benchmarks/fused_stream_floor.py reads this layout as fast as a
plain streaming read).

Every program must be resident at once (a program spins on others): the launch is cooperative, so the driver
refuses a grid that could not be, and `fused_fits` keeps the grid within two programs an SM (8 warps at <= 128
registers each). Down rows in trips of RB x 16 MR2 rows: warp w takes row block w // GS and groups 4 (w % GS) ..
+ 3 of each row (GS = I / 128 warps cover K in one trip), so x (H) is loaded and unpacked once a program.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .int4_gemv import _pair
from .int4_mma import _mma, _mma_dot, _row_sums, _trip_w, _trip_x, check_layout
from .pdl import pdl_release, pdl_wait

WG = 8  # warps a program, both phases
MR1 = 2  # gemv1: 8 MR1 = 16 gate rows a program (int4_mma_gemv's tile at MoE-TP4, one token)
MR2 = 1  # down rows: 16 MR2 a row block
MAX_PAIRS = 64  # the counts buffer's pairs (one token: top-K <= 64)
PAD = 32  # int32s between two pairs' counts: one 128-byte line each


@triton.jit(do_not_specialize=["expert_offset"])
def _int4_mma_fused_kernel(
    X32,
    W13,
    S13,
    W2,
    S2,
    Hbuf,
    H32,
    Y,
    TopkW,
    TopkIds,
    Arrived,
    Left,
    I,
    D,
    NG1,
    stride_xt,
    stride_we1,
    stride_wn1,
    stride_se1,
    stride_sn41,
    stride_hm,
    stride_hm32,
    stride_we2,
    stride_wn2,
    stride_se2,
    stride_sn42,
    stride_yt,
    expert_offset,
    E_LOCAL,
    TOPK: tl.constexpr,
    NSL: tl.constexpr,
    NG2: tl.constexpr,
    ROWS2: tl.constexpr,
    WG: tl.constexpr,
    MR1: tl.constexpr,
    MR2: tl.constexpr,
    MUL: tl.constexpr,
    PDL: tl.constexpr,
    PAD: tl.constexpr,
):
    pdl_wait(PDL)
    pdl_release(PDL)
    p = tl.program_id(0) // NSL
    j = tl.program_id(0) % NSL
    e, own = _pair(p, TopkIds, expert_offset, E_LOCAL, False)
    if not own:  # the pair's every program exits alike: none waits on it
        return
    none = p < 0  # no token B (one token: no two pairs share an expert)
    # gemv1's block j: H[p, n0 .. n0 + 8 MR1]
    n0 = j * (8 * MR1)
    m = tl.arange(0, MR1)[:, None]
    n = n0 + 8 * m + (tl.arange(0, 128 * WG)[None, :] // 16) % 8  # [MR1, V]: each lane's gate row
    W, S = W13 + e * stride_we1, S13 + e * stride_se1
    Wb, Sb = W + I * stride_wn1, S + I * (4 * stride_sn41)
    xa = X32 + (p // TOPK).to(tl.int64) * stride_xt
    ok = n < I
    acc = _mma_dot(
        W, Wb, S, Sb, n * stride_wn1, n * (4 * stride_sn41), ok, ok, xa, xa, none, NG1, MR1, WG, True, False,
        True, False, MUL, 1,
    )  # fmt: skip
    gate, up = tl.split(_row_sums(acc, MR1, WG))  # [MR1, 8, 2]: tokens A, B
    h = tl.split(gate * tl.sigmoid(gate) * up)[0]  # token A
    g = tl.arange(0, 8)[None, :]
    pos = n0 + 8 * m + 2 * (g % 4) + g // 4  # column 8 i + j at 8 i + 2 (j % 4) + j // 4: pairs (j, j + 4)
    tl.store(Hbuf + p * stride_hm + pos, h.to(Hbuf.dtype.element_ty))
    tl.debug_barrier()  # every thread's stores before the release
    tl.atomic_add(Arrived + p * PAD, 1, sem="release", scope="gpu")

    # the down rows d0 .. d0 + ROWS2 of pair p, in trips of RB blocks of 16 MR2 rows
    GS: tl.constexpr = NG2 // 4  # warps on K
    RB: tl.constexpr = WG // GS  # row blocks a trip
    TRIP: tl.constexpr = RB * 16 * MR2
    v = tl.arange(0, 128 * WG)[None, :]
    gs = (v // 128) % GS
    t = (v // 4) % 4
    grp = 4 * gs + t
    woff = 16 * gs + v % 16
    sgrp = 4 * gs + v % 4
    xoff = 16 * grp + v % 4
    diag = (v // 16) % 8 == t
    dl = (v // 128) // GS * (16 * MR2) + 8 * tl.arange(0, MR2)[:, None] + (v // 16) % 8  # [MR2, V]: top rows
    W, S = W2 + e * stride_we2, S2 + e * stride_se2
    Wb, Sb = W + 8 * MR2 * stride_wn2, S + 8 * MR2 * (4 * stride_sn42)
    d0 = j * ROWS2
    d = d0 + dl
    yes = d >= 0
    wt, wb, st, sb = _trip_w(
        W, Wb, S, Sb, d * stride_wn2, d * (4 * stride_sn42), yes, yes, 0, NG2, woff, sgrp, grp, True
    )
    # one thread polls (a scalar atomic; its value reaches the others through shared memory and a barrier), so
    # waiting programs do not flood the count's L2 slice
    while tl.atomic_add(Arrived + p * PAD, 0, sem="acquire", scope="gpu") < NSL:
        pass
    y0, y1, y2, y3, xs = _trip_x(
        H32 + p.to(tl.int64) * stride_hm32, H32, none, 0, NG2, xoff, diag, diag & none, grp, True, True
    )
    if tl.atomic_add(Left + p * PAD, 1, sem="relaxed", scope="gpu") == NSL - 1:  # the last one past the spin
        tl.atomic_xchg(Arrived + p * PAD, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(Left + p * PAD, 0, sem="relaxed", scope="gpu")
    tw = tl.load(TopkW + p)
    ya = Y + p * stride_yt
    zero = tl.zeros([MR2, 128 * WG], tl.float32)
    for r0 in range(d0, d0 + ROWS2, TRIP):
        nd = r0 + TRIP + dl
        more = nd < d0 + ROWS2
        nt, nb, nst, nsb = _trip_w(
            W, Wb, S, Sb, nd * stride_wn2, nd * (4 * stride_sn42), more, more, 0, NG2, woff, sgrp, grp, False
        )
        dots = _mma(wt, wb, st, sb, y0, y1, y2, y3, xs, zero, MUL)
        a = tl.reshape(dots, (MR2, RB, GS, 8, 2, 2, 2, 2))  # m, row block, gs, g, token, t % 2, top / bottom, parity
        a = tl.sum(tl.sum(tl.sum(a, 7), 5), 2) * 0.125  # [MR2, RB, 8, token, top / bottom]
        top, bot = tl.split(a)
        top = tl.split(top)[0]  # token A
        bot = tl.split(bot)[0]
        rt = r0 + tl.arange(0, RB)[None, :, None] * (16 * MR2) + 8 * tl.arange(0, MR2)[:, None, None]
        rt = rt + tl.arange(0, 8)[None, None, :]
        tl.store(ya + rt, (top * tw).to(Y.dtype.element_ty))
        tl.store(ya + rt + 8 * MR2, (bot * tw).to(Y.dtype.element_ty))
        wt, wb, st, sb = nt, nb, nst, nsb


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_COUNTS: dict = {}


def _counts(device: torch.device) -> torch.Tensor:
    """The per-pair counts [2, MAX_PAIRS * PAD] int32 of `device` (pair p's at p * PAD): zero between calls (each
    call's last program resets its pairs'), made once, outside any CUDA graph capture (the engine's warm-up runs a
    step eagerly first)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    c = _COUNTS.get(key)
    if c is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("int4_gemv_fused: run once outside CUDA graph capture first (its counts buffer)")
        c = _COUNTS[key] = torch.zeros(2, MAX_PAIRS * PAD, dtype=torch.int32, device=device)
    return c


def fused_fits(T: int, K: int, D: int, I: int, device: torch.device) -> bool:
    """Whether a step of T tokens of top-K on a D -> I shard can take the one-launch form: one token, the down
    projection's K in one trip of 8 warps (I in 128, 256, 512), gemv1's K in whole trips (D a multiple of 1024),
    whole trips of down rows a program, and all
    K * I / 16 programs resident at once (two an SM)."""
    if T != 1 or K > MAX_PAIRS or I not in (128, 256, 512) or D % (128 * WG) or device.type != "cuda":
        return False
    nsl = I // (8 * MR1)
    trip = WG // (I // 128) * 16 * MR2
    return D % (nsl * trip) == 0 and K * nsl <= 2 * _sm_count(device.index if device.index is not None else 0)


def int4_gemv_fused(x, w13, s13, w2, s2, topk_weights, topk_ids, expert_offset, hbuf, y, pdl, mul=False, rows=None):
    """Both GEMVs of a one-token step in one launch, into hbuf [K, I] (bf16, pair order) and y [K, D]; the caller
    checked fused_fits and int4_mma_run.mma_supported. rows (benchmarks): down rows a program (default D / NSL; 0:
    gemv1 and the wait alone, y unwritten)."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    K = topk_ids.shape[-1]
    nsl = I // (8 * MR1)
    ng2 = I // 32
    counts = _counts(x.device)
    x32, h32 = x.view(torch.int32), hbuf.view(torch.int32)
    k = _int4_mma_fused_kernel[(K * nsl,)](
        x32,
        w13,
        s13,
        w2,
        s2,
        hbuf,
        h32,
        y,
        topk_weights.reshape(-1),
        topk_ids.reshape(-1),
        counts[0],
        counts[1],
        I,
        D,
        D // 32,
        x32.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1) // 4,
        hbuf.stride(0),
        h32.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1) // 4,
        y.stride(0),
        expert_offset,
        E,
        TOPK=K,
        NSL=nsl,
        NG2=ng2,
        ROWS2=D // nsl if rows is None else rows,
        WG=WG,
        MR1=MR1,
        MR2=MR2,
        MUL=mul,
        PAD=PAD,
        num_warps=WG,
        num_stages=1,
        maxnreg=128,
        launch_cooperative_grid=True,
        **pdl,
    )
    check_layout(k, WG)
