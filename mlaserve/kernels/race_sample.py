"""Sampled rows without sorting: temperature, top-k, top-p and min-p, then the exponential race, over noise the
caller drew (layers/sampler.py's race_noise, so a seeded request's tokens stay its generator's).

The torch reference (sampler.py's _filter, softmax, then argmax(p / E)) sorts each row for top-k / top-p and takes
14-50 launches. The kept set of top-k, top-p and min-p is an upper set of the row's values: token j is kept iff
fewer than k values lie above it, their mass is below top_p, and its own q_j = exp(x_j - max) >= min_p. So the
race's winner over the values above a bound (at first all of them), if kept, is the winner over the kept set too;
if not, nothing at or below it is kept, and the race runs again above it. The top token is always kept, so this
ends; with top-p alone a winner is rejected with probability about 1 - top_p.

Three launches over (row, chunk) programs, so a long row is read by many SMs: the chunks' max, sum and race winner;
with top-k, top-p or min-p, each chunk's count and mass above the row's winner and its race above it; one program a
row picks the first winner or the next, and only past a second rejection reads its whole row alone, round by
round. Temperature alone skips the middle launch; a row of one chunk (a small vocabulary) is one launch.

Scores are x - log(E) (x = logit / temperature), the log of the reference's p / E up to a constant. Ties at the
k-th value or at the top-p boundary keep every tied token (the sort keeps the first of them); the row's masses are
summed in another order than the sort's cumsum. Rows with both top-k and top-p (top-p over the top-k set's
renormalised mass) take the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_release, pdl_wait

BLOCK = 2048  # values a program holds per trip (per-lane partials: 8 a thread)
CHUNK = 8192  # values a first-pass program reads: 20 programs a row of Moonlight's and Kimi's 163840
FIELDS = 6  # rows of the params tensor: logit row, noise row, 1 / temperature, top_p, min_p, top_k


@triton.jit
def _first_best(best, bidx):
    """(max, first index of it) over lanes that each hold (their best score, its first index)."""
    bm = tl.max(best, 0)
    return bm, tl.min(tl.where(best == bm, bidx, 2147483647), 0)


@triton.jit
def _span(Xr, Nr, start, stop, invt, m, xj, BLOCK: tl.constexpr, STATS: tl.constexpr, COUNT: tl.constexpr):
    """One pass over values [start, stop) of a row, per-lane partials reduced once at the end (a reduction per trip
    costs more than the trip's loads): (max, sum of exp(x - max)) with STATS; the race over the values above xj
    (its best score and first index); with COUNT the count and mass (exp(x - m)) of the values above xj."""
    offs = tl.arange(0, BLOCK)
    mv = tl.full([BLOCK], -3.0e38, tl.float32)
    zv = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    bidx = tl.zeros([BLOCK], tl.int32)
    cnt = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    for off in range(start, stop, BLOCK):
        i = off + offs
        ok = i < stop
        x = tl.load(Xr + i, mask=ok, other=float("-inf")).to(tl.float32) * invt
        e = tl.load(Nr + i, mask=ok, other=1.0)
        if STATS:
            nm = tl.maximum(mv, x)
            zv = zv * tl.exp(mv - nm) + tl.exp(x - nm)
            mv = nm
        above = x > xj
        if COUNT:
            cnt += above.to(tl.int32)
            mass += tl.where(above, tl.exp(x - m), 0.0)
        sc = tl.where(above, x - tl.log(e), float("-inf"))
        upd = sc > best
        bidx = tl.where(upd, i, bidx)
        best = tl.where(upd, sc, best)
    cm = tl.max(mv, 0)
    bs, bi = _first_best(best, bidx)
    return cm, tl.sum(zv * tl.exp(mv - cm), 0), bs, bi, tl.sum(cnt, 0), tl.sum(mass, 0)


@triton.jit
def _params(Par, S, s):
    row = tl.load(Par + s).to(tl.int64)
    nrow = tl.load(Par + S + s).to(tl.int64)
    invt = tl.load(Par + 2 * S + s)
    tp = tl.load(Par + 3 * S + s)
    mp = tl.load(Par + 4 * S + s)
    k = tl.load(Par + 5 * S + s).to(tl.int32)
    return row, nrow, invt, tp, mp, k


@triton.jit
def _first_pass(PF, PI, s, C, CP: tl.constexpr):
    """The row's (max, sum of exp(x - max), race winner) from its C chunks' first-pass partials."""
    c = tl.arange(0, CP)
    ok = c < C
    cm = tl.load(PF + (s * C + c) * 3, mask=ok, other=-3.0e38)
    cz = tl.load(PF + (s * C + c) * 3 + 1, mask=ok, other=0.0)
    cb = tl.load(PF + (s * C + c) * 3 + 2, mask=ok, other=float("-inf"))
    ci = tl.load(PI + s * C + c, mask=ok, other=2147483647)
    m = tl.max(cm, 0)
    _, tok = _first_best(cb, ci)
    return m, tl.sum(cz * tl.exp(cm - m), 0), tok


@triton.jit
def _kept(cnt, mass, xj, m, z, tp, mp, k):
    """The race's winner (value xj) is kept: fewer than k values above it (k > 0), their mass under top_p, and its
    own q = exp(xj - max) at least min_p. Each holds for an upper set of the row's values."""
    return ((k <= 0) | (cnt < k)) & ((tp >= 1.0) | (mass < tp * z)) & (tl.exp(xj - m) >= mp)


@triton.jit(do_not_specialize=["S"])
def _race_chunks_kernel(
    X,
    stride_x,
    Nz,
    stride_n,
    Par,
    PF,
    PI,
    S,
    V,
    C,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    STATS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (s, c): chunk c's first-pass partials of sampled row s: its max and sum (STATS) and its race winner
    over every value -> PF[s, c] = (max, sum, best score), PI[s, c] = the winner's index."""
    pdl_release(PDL)
    pdl_wait(PDL)  # the params are copied in just before this launch: not a step input (pdl.py)
    s, c = tl.program_id(0), tl.program_id(1)
    row, nrow, invt, _, _, _ = _params(Par, S, s)
    start = c * CHUNK
    stop = tl.minimum(start + CHUNK, V)
    cm, cz, bs, bi, _, _ = _span(
        X + row * stride_x, Nz + nrow * stride_n, start, stop, invt, 0.0, float("-inf"), BLOCK, STATS, False
    )
    tl.store(PF + (s * C + c) * 3, cm)
    tl.store(PF + (s * C + c) * 3 + 1, cz)
    tl.store(PF + (s * C + c) * 3 + 2, bs)
    tl.store(PI + s * C + c, bi)


@triton.jit(do_not_specialize=["S"])
def _race_check_kernel(
    X,
    stride_x,
    Nz,
    stride_n,
    Par,
    PF,
    PI,
    QF,
    QI,
    S,
    V,
    C,
    CP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (s, c): for the first pass's winner j of row s, chunk c's count and mass above x_j and its race over
    the values above x_j (the next winner, should j not be kept) -> QF[s, c] = (mass, best score), QI[s, c] =
    (count, index)."""
    pdl_release(PDL)
    pdl_wait(PDL)
    s, c = tl.program_id(0), tl.program_id(1)
    row, nrow, invt, _, _, _ = _params(Par, S, s)
    m, _, tok = _first_pass(PF, PI, s, C, CP)
    Xr = X + row * stride_x
    xj = tl.load(Xr + tok).to(tl.float32) * invt
    start = c * CHUNK
    stop = tl.minimum(start + CHUNK, V)
    _, _, bs, bi, cnt, mass = _span(Xr, Nz + nrow * stride_n, start, stop, invt, m, xj, BLOCK, False, True)
    tl.store(QF + (s * C + c) * 2, mass)
    tl.store(QF + (s * C + c) * 2 + 1, bs)
    tl.store(QI + (s * C + c) * 2, cnt)
    tl.store(QI + (s * C + c) * 2 + 1, bi)


@triton.jit(do_not_specialize=["S"])
def _race_pick_kernel(
    X,
    stride_x,
    Nz,
    stride_n,
    Par,
    PF,
    PI,
    QF,
    QI,
    Out,
    S,
    V,
    C,
    CP: tl.constexpr,
    BLOCK: tl.constexpr,
    CHECK: tl.constexpr,
    ONE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program s: Out[row] = the row's token. CHECK (some row has top-k, top-p or min-p): the first winner if kept
    (_kept over the check pass's sums), else the next one if kept, else rounds over the whole row in this program:
    each a pass that counts above the winner and races above it (rare with top-p alone; with top-k or min-p on a
    flat row, a few). ONE: the row is one chunk, and this program makes the first and check passes itself (one
    launch in all: short rows, where launches cost more than the passes)."""
    pdl_release(PDL)
    pdl_wait(PDL)
    s = tl.program_id(0)
    row, nrow, invt, tp, mp, k = _params(Par, S, s)
    Xr, Nr = X + row * stride_x, Nz + nrow * stride_n
    if ONE:
        m, z, _, tok, _, _ = _span(Xr, Nr, 0, V, invt, 0.0, float("-inf"), BLOCK, CHECK, False)
    else:
        m, z, tok = _first_pass(PF, PI, s, C, CP)
    if CHECK:
        xj = tl.load(Xr + tok).to(tl.float32) * invt
        if ONE:
            _, _, nb, nxt, cnt, mass = _span(Xr, Nr, 0, V, invt, m, xj, BLOCK, False, True)
        else:
            c = tl.arange(0, CP)
            ok = c < C
            cnt = tl.sum(tl.load(QI + (s * C + c) * 2, mask=ok, other=0), 0)
            mass = tl.sum(tl.load(QF + (s * C + c) * 2, mask=ok, other=0.0), 0)
            cb = tl.load(QF + (s * C + c) * 2 + 1, mask=ok, other=float("-inf"))
            ci = tl.load(QI + (s * C + c) * 2 + 1, mask=ok, other=2147483647)
            nb, nxt = _first_best(cb, ci)
        # nothing above the winner (nb = -inf): it is the top value and stays (kept, unless the row holds a NaN or
        # an inf, whose sums are NaN: then this ends the rounds, which every other case ends by raising x_j)
        done = _kept(cnt, mass, xj, m, z, tp, mp, k) | (nb == float("-inf"))
        if not done:  # nothing at or below x_j is kept: the race above it
            tok = nxt
        while not done:
            xj = tl.load(Xr + tok).to(tl.float32) * invt
            _, _, nb, nxt, cnt, mass = _span(Xr, Nr, 0, V, invt, m, xj, BLOCK, False, True)
            done = _kept(cnt, mass, xj, m, z, tp, mp, k) | (nb == float("-inf"))
            if not done:
                tok = nxt
    tl.store(Out + row, tok.to(tl.int64))


def race_sample(
    logits: torch.Tensor,
    noise: torch.Tensor,
    params: torch.Tensor,
    out: torch.Tensor,
    min_p: bool,
    check: bool,
    pdl: bool = True,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """out[row] for each column of params (fp32 [FIELDS, S] on the device: logit row, noise row, 1 / temperature,
    top_p, min_p, top_k (0: off); rows with both top_k and top_p < 1 are the caller's): the token that row's
    filtered distribution gives with its noise row of Exp(1) draws. logits [R, V] float, noise [*, V] fp32, both with
    unit last strides; out [R] int64. min_p / check: whether any row has min_p > 0 / top_k > 0 or top_p < 1.
    chunk: values a first-pass program reads (a power of 2; tests make it small to cut short rows)."""
    R, V = logits.shape
    if logits.stride(-1) != 1 or noise.stride(-1) != 1 or noise.shape[-1] != V or noise.dtype != torch.float32:
        raise ValueError(
            f"race_sample: logits [R, V] and noise fp32 [*, V] with unit last strides, got {tuple(logits.shape)} "
            f"{logits.stride()}, {tuple(noise.shape)} {noise.dtype} {noise.stride()}"
        )
    if params.dim() != 2 or params.shape[0] != FIELDS or params.dtype != torch.float32 or not params.is_contiguous():
        raise ValueError(f"race_sample: params must be contiguous fp32 [{FIELDS}, S], got {tuple(params.shape)}")
    S = params.shape[1]
    if S:
        if chunk & (chunk - 1) or chunk < 16:
            raise ValueError(f"race_sample: chunk={chunk} must be a power of 2 >= 16")
        blk = min(BLOCK, chunk, max(16, triton.next_power_of_2(V)))
        C = triton.cdiv(V, chunk)
        CP = max(2, triton.next_power_of_2(C))
        stats = min_p or check
        if C > 1:  # the chunks' partials
            pf = torch.empty(S, C, 3, dtype=torch.float32, device=logits.device)
            pi = torch.empty(S, C, dtype=torch.int32, device=logits.device)
            qf = torch.empty(S, C, 2, dtype=torch.float32, device=logits.device) if stats else pf
            qi = torch.empty(S, C, 2, dtype=torch.int32, device=logits.device) if stats else pi
        else:  # read by no program (ONE)
            pf = qf = params
            pi = qi = torch.empty(1, dtype=torch.int32, device=logits.device)
        pdl = pdl_args(logits, pdl)
        args = (logits, logits.stride(0), noise, noise.stride(0), params)
        if C > 1:
            _race_chunks_kernel[(S, C)](*args, pf, pi, S, V, C, CHUNK=chunk, BLOCK=blk, STATS=stats, num_warps=8, **pdl)
            if stats:
                _race_check_kernel[(S, C)](
                    *args, pf, pi, qf, qi, S, V, C, CP=CP, CHUNK=chunk, BLOCK=blk, num_warps=8, **pdl
                )
        _race_pick_kernel[(S,)](
            *args, pf, pi, qf, qi, out, S, V, C, CP=CP, BLOCK=blk, CHECK=stats, ONE=C == 1, num_warps=8, **pdl
        )
    return out


def warm_race_sample(logits: torch.Tensor, pdl: bool = True) -> None:
    """Compile the kernels' forms (with and without the check pass) for these logits (the engine's warm-up: no
    compile while serving). Row 0 only, its token written to a scratch buffer."""
    V = logits.shape[1]
    noise = torch.ones(1, V, device=logits.device)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    par = torch.tensor([[0.0], [0.0], [1.0], [0.5], [0.1], [1.0]], device=logits.device)
    for check in (False, True):
        race_sample(logits, noise, par, out, False, check, pdl)
