"""Sampled rows in one launch: temperature, top-k, top-p and min-p, then the exponential race, over noise the caller
drew (layers/sampler.py's race_noise, so a seeded request's tokens stay its generator's).

The torch reference (sampler.py's _filter, softmax, then argmax(p / E)) sorts each row for top-k / top-p and takes
14-50 launches. Here one program a row never sorts. The kept set of top-k, top-p and min-p is an upper set of the
row's values: token j is kept iff fewer than k values lie above it, their mass is below top_p, and its own q_j =
exp(x_j - max) >= min_p. So the race's winner over the values above a bound (at first all of them), if kept, is
the winner over the kept set too; if not, nothing at or below it is kept, the bound rises to it and the race runs
again. The top value is always kept, so this ends; with top-p alone a winner is rejected with probability about
1 - top_p. Each pass keeps per-lane partials and reduces across lanes once at its end.

Scores are x - log(E) (x = logit / temperature), the log of the reference's p / E up to a constant. Ties at the
k-th value or at the top-p boundary keep every tied token (the sort keeps the first of them); the row's masses are
summed in another order than the sort's cumsum. Rows with both top-k and top-p (top-p over the top-k set's
renormalised mass) are the sampler's: a race over their top-k candidates (sampler.py's _candidates_into).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_release, pdl_wait

BLOCK = 2048  # values a program holds per trip over its row (per-lane partials: 8 a thread)
FIELDS = 6  # rows of the params tensor: logit row, noise row, 1 / temperature, top_p, min_p, top_k


@triton.jit
def _first_best(best, bidx):
    """The first index of the maximum over lanes that each hold (their best score, its first index)."""
    bm = tl.max(best, 0)
    return tl.min(tl.where(best == bm, bidx, 2147483647), 0)


@triton.jit
def _trip(Xr, Nr, i, ok, invt):
    """One trip's values x = logit / temperature (-inf past the row) and their noise E (1.0 past it)."""
    x = tl.load(Xr + i, mask=ok, other=float("-inf")).to(tl.float32) * invt
    return x, tl.load(Nr + i, mask=ok, other=1.0)


@triton.jit
def _race(x, e, i, keep, best, bidx):
    """The race's per-lane partials after one trip: each lane's best score x - log(E) over its kept values, and
    the first index of it."""
    sc = tl.where(keep, x - tl.log(e), float("-inf"))
    upd = sc > best
    bidx = tl.where(upd, i, bidx)
    return tl.where(upd, sc, best), bidx


@triton.jit
def _kernel_body(Xr, Nr, V, invt, tp, mp, k, BLOCK: tl.constexpr, MINP: tl.constexpr, CHECK: tl.constexpr):
    """The row's token. Every pass keeps per-lane partials (max, sum, best score and its first index, counts) and
    reduces across lanes once at its end: a reduction per trip would cost more than the trip's loads."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([], -3.0e38, tl.float32)
    z = tl.full([], 0.0, tl.float32)
    if MINP or CHECK:  # the row's max and sum of exp(x - max)
        mv = tl.full([BLOCK], -3.0e38, tl.float32)
        zv = tl.zeros([BLOCK], tl.float32)
        for off in range(0, V, BLOCK):
            i = off + offs
            x = tl.load(Xr + i, mask=i < V, other=float("-inf")).to(tl.float32) * invt
            nm = tl.maximum(mv, x)
            zv = zv * tl.exp(mv - nm) + tl.exp(x - nm)
            mv = nm
        m = tl.max(mv, 0)
        z = tl.sum(zv * tl.exp(mv - m), 0)
    # the race over every value (with MINP: those with q >= min_p)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    bidx = tl.zeros([BLOCK], tl.int32)
    for off in range(0, V, BLOCK):
        i = off + offs
        ok = i < V
        x, e = _trip(Xr, Nr, i, ok, invt)
        keep = ok
        if MINP:
            keep = keep & (tl.exp(x - m) >= mp)
        best, bidx = _race(x, e, i, keep, best, bidx)
    tok = _first_best(best, bidx)
    if CHECK:
        done = (k <= 0) & (tp >= 1.0)
        while not done:
            # one pass: the count and mass above the winner, and the race over the values above it (the next
            # winner, if this one is not kept: then nothing at or below it is)
            xj = tl.load(Xr + tok).to(tl.float32) * invt
            cnt = tl.zeros([BLOCK], tl.int32)
            mass = tl.zeros([BLOCK], tl.float32)
            best = tl.full([BLOCK], float("-inf"), tl.float32)
            bidx = tl.zeros([BLOCK], tl.int32)
            for off in range(0, V, BLOCK):
                i = off + offs
                ok = i < V
                x, e = _trip(Xr, Nr, i, ok, invt)
                q = tl.exp(x - m)
                above = x > xj
                cnt += above.to(tl.int32)
                mass += tl.where(above, q, 0.0)
                keep = above
                if MINP:
                    keep = keep & (q >= mp)
                best, bidx = _race(x, e, i, keep, best, bidx)
            n_above = tl.sum(cnt, 0)
            done = ((k <= 0) | (n_above < k)) & ((tp >= 1.0) | (tl.sum(mass, 0) < tp * z))
            # nothing above the winner: it is the top value and stays (kept, unless the row holds a NaN or an inf,
            # whose sums are NaN: then this ends the rounds, which every other case ends by raising xj)
            done = done | (tl.max(best, 0) == float("-inf"))
            if not done:
                tok = _first_best(best, bidx)
    return tok


@triton.jit(do_not_specialize=["S"])
def _race_sample_kernel(
    X,
    stride_x,
    Nz,
    stride_n,
    Par,
    Out,
    S,
    V,
    BLOCK: tl.constexpr,
    MINP: tl.constexpr,
    CHECK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program s: Out[row] = the race's token of logit row `row` over noise row `nrow` (Par[:, s], FIELDS). MINP:
    some row has min_p > 0; CHECK: some row has top_k > 0 or top_p < 1 (both read the row's max and mass first)."""
    pdl_release(PDL)
    pdl_wait(PDL)  # the params are copied in just before this launch: not a step input (pdl.py)
    s = tl.program_id(0)
    row = tl.load(Par + s).to(tl.int64)
    nrow = tl.load(Par + S + s).to(tl.int64)
    invt = tl.load(Par + 2 * S + s)
    tp = tl.load(Par + 3 * S + s)
    mp = tl.load(Par + 4 * S + s)
    k = tl.load(Par + 5 * S + s).to(tl.int32)
    tok = _kernel_body(X + row * stride_x, Nz + nrow * stride_n, V, invt, tp, mp, k, BLOCK, MINP, CHECK)
    tl.store(Out + row, tok.to(tl.int64))


def race_sample(
    logits: torch.Tensor,
    noise: torch.Tensor,
    params: torch.Tensor,
    out: torch.Tensor,
    min_p: bool,
    check: bool,
    pdl: bool = True,
) -> torch.Tensor:
    """out[row] for each column of params (fp32 [FIELDS, S] on the device: logit row, noise row, 1 / temperature,
    top_p, min_p, top_k (0: off); rows with both top_k and top_p < 1 are the caller's): the token that row's
    filtered distribution gives with its noise row of Exp(1) draws. logits [R, V] float, noise [*, V] fp32, both with
    unit last strides; out [R] int64. min_p / check: whether any row has min_p > 0 / top_k > 0 or top_p < 1."""
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
        _race_sample_kernel[(S,)](
            logits,
            logits.stride(0),
            noise,
            noise.stride(0),
            params,
            out,
            S,
            V,
            BLOCK=min(BLOCK, max(16, triton.next_power_of_2(V))),
            MINP=min_p,
            CHECK=check,
            num_warps=8,
            **pdl_args(logits, pdl),
        )
    return out


def warm_race_sample(logits: torch.Tensor, pdl: bool = True) -> None:
    """Compile the kernel's four forms (min-p or not, top-k / top-p or not) for these logits (the engine's warm-up:
    no compile while serving). Row 0 only, its token written to a scratch buffer."""
    V = logits.shape[1]
    noise = torch.ones(1, V, device=logits.device)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    par = torch.tensor([[0.0], [0.0], [1.0], [0.5], [0.1], [1.0]], device=logits.device)
    for min_p in (False, True):
        for check in (False, True):
            race_sample(logits, noise, par, out, min_p, check, pdl)
