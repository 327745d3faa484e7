"""NGRAM's draft on the device: append a verify's emitted tokens to each request's token row, then look up the
context's longest suffix n-gram, one program a request. Equal to spec/ngram.py's `ngram_drafts_ref` (the torch
rule, which the CPU runs and the tests hold this to).

Program b (request b, slot s = Slots[b], first verified position base = Base[b]; base < 0: a padding row, drafts 0):
    Hist[s, base + 1 + i] = Y[b, i]  (i < N)        the step's tokens; the context is Hist[s, :L], L = base + Acc[b] + 2
    m(p) for each p in [1, L): how many of T[p-1], T[p-2], ... equal T[L-1], T[L-2], ... (at most HI)
    the same over Pred[s, :PredLens[s]] (the prediction), which wins ties of m
    best: the largest m >= LO, then the prediction, then the latest p; drafts[b, i] = src[min(p + i, len(src) - 1)]
    (no match: T[L-1] repeated); Counts += [K, K if a match was found].
The search reads the row's L x HI tokens (cached: each is read HI times); an 8k-token context at HI = 5 is 40k loads,
in trips of 1,024 positions whose HI loads do not depend on each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_start


@triton.jit
def _match(Src, p, inb, Hist, L, r, alive, m):
    """One more token back: alive where Src[p - r] equals the suffix's r-th last token too; m counts them. The load
    is masked by the bounds only, not by `alive`, so a trip's HI loads do not wait on each other."""
    t = tl.load(Hist + L - r, mask=L - r >= 0, other=-1)  # the suffix's r-th last token
    v = tl.load(Src + p - r, mask=inb & (p - r >= 0), other=-2)
    alive = alive & (v == t)
    return alive, m + alive.to(tl.int64)


@triton.jit
def _best_in(Src, src_len, Hist, L, best, is_pred, HI: tl.constexpr, LO: tl.constexpr, BLOCK: tl.constexpr):
    """The largest key m * 2^33 + is_pred * 2^32 + p over p in [1, src_len) of Src with m >= LO (best if larger)."""
    for start in range(1, src_len, BLOCK):
        p = start + tl.arange(0, BLOCK)
        inb = p < src_len
        alive = inb
        m = tl.zeros([BLOCK], dtype=tl.int64)
        if HI <= 8:  # unrolled: the loads issue together
            for r in tl.static_range(1, HI + 1):
                alive, m = _match(Src, p, inb, Hist, L, r, alive, m)
        else:
            for r in range(1, HI + 1):
                alive, m = _match(Src, p, inb, Hist, L, r, alive, m)
        key = tl.where(m >= LO, m * 8589934592 + is_pred * 4294967296 + p, -1)
        best = tl.maximum(best, tl.max(key, 0))
    return best


@triton.jit(
    do_not_specialize=["Hist", "Pred", "PredLens", "Slots", "Base", "Shift", "Acc", "Y", "Out", "Counts", "stride_y"]
)
def _ngram_kernel(
    Hist,
    Pred,
    PredLens,
    Slots,
    Base,
    Shift,
    Acc,
    Y,
    Out,
    Counts,
    stride_h,
    stride_p,
    stride_y,
    cap,
    N: tl.constexpr,
    NP: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    LO: tl.constexpr,
    HI: tl.constexpr,
    SHIFT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    base = tl.load(Base + b)
    live = base >= 0
    if SHIFT:
        base += tl.load(Shift + b)  # 0 on padding rows
    s = tl.load(Slots + b, mask=live, other=0).to(tl.int64)
    row = Hist + s * stride_h
    i = tl.arange(0, NP)
    y = tl.load(Y + b * stride_y + i, mask=i < N, other=0)
    pos = base + 1 + i
    tl.store(row + pos, y.to(tl.int32), mask=live & (i < N) & (pos < cap))
    tl.debug_barrier()  # the appended tokens are read back below by other threads of this program
    L = tl.where(live, base + tl.load(Acc + b, mask=live, other=0) + 2, 0)
    best = tl.full([], -1, tl.int64)
    best = _best_in(row, L, row, L, best, 0, HI, LO, BLOCK)
    plen = tl.where(live, tl.load(PredLens + s, mask=live, other=0), 0)
    prow = Pred + s * stride_p
    best = _best_in(prow, plen, row, L, best, 1, HI, LO, BLOCK)
    found = best >= 0
    from_pred = found & (((best // 4294967296) % 2) == 1)
    p = tl.where(found, best % 4294967296, L - 1)  # no match: T[L-1] repeated
    j = tl.arange(0, KP)
    ok = live & (j < K)
    ctx_tok = tl.load(row + tl.minimum(p + j, L - 1), mask=ok & ~from_pred, other=0)
    pred_tok = tl.load(prow + tl.minimum(p + j, plen - 1), mask=ok & from_pred, other=0)
    tl.store(Out + b * K + j, tl.where(from_pred, pred_tok, ctx_tok).to(tl.int64), mask=j < K)
    if live:
        tl.atomic_add(Counts, K)
        if found:
            tl.atomic_add(Counts + 1, K)


def ngram_drafts(
    hist: torch.Tensor,
    pred: torch.Tensor,
    pred_lens: torch.Tensor,
    slots: torch.Tensor,
    base: torch.Tensor,
    acc: torch.Tensor,
    y: torch.Tensor,
    k: int,
    lo: int,
    hi: int,
    counts: torch.Tensor,
    shift: torch.Tensor | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """hist [S, C] and pred [S, P] int32 token rows, pred_lens [S] int64, slots / base / acc [B] int64 (base < 0: a
    padding row), y [B, N] int64, counts [2] int64, shift [B] int64 or None (added to base) -> drafts [B, k] int64;
    hist and counts changed in place (spec/ngram.py's ngram_drafts_ref)."""
    B, N = y.shape
    out = torch.empty(B, k, dtype=torch.int64, device=y.device)
    if B:
        y = y if y.stride(-1) == 1 else y.contiguous()
        _ngram_kernel[(B,)](
            hist,
            pred,
            pred_lens,
            slots,
            base,
            base if shift is None else shift,
            acc,
            y,
            out,
            counts,
            hist.stride(0),
            pred.stride(0),
            y.stride(0),
            hist.shape[1],
            N=N,
            NP=max(2, triton.next_power_of_2(N)),
            K=k,
            KP=max(2, triton.next_power_of_2(k)),
            LO=lo,
            HI=hi,
            SHIFT=shift is not None,
            BLOCK=1024,
            num_warps=4,
            **pdl_args(y, pdl),
        )
    return out


def warm_up(hist, pred, pred_lens, counts, n: int, k: int, lo: int, hi: int, pdl: bool = True) -> None:
    """Compile both variants (with a shift and without) for a verify of width n, on padding rows only."""
    z = dict(dtype=torch.int64, device=hist.device)
    base, y = torch.full((1,), -1, **z), torch.zeros(1, n, **z)
    for shift in (None, torch.zeros(1, **z)):
        ngram_drafts(hist, pred, pred_lens, base + 1, base, base + 1, y, k, lo, hi, counts, shift, pdl)
