"""MLA decode's combine of split partials: out = sum_s 2^(lse_s - max) PartO_s / sum_s 2^(lse_s - max).

`_mla_decode_combine_kernel`, launched by mla_decode after its split kernel, reads the partials (PartO [T, H, S, R],
PartLse [T, H, S]): all splits of a (token, head, R block) as one tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_release, pdl_wait

COMBINE_TILE = 8192  # elements of the combine's [splits, BLOCK_R] fp32 tile (4 warps)


@triton.jit
def _tiles_per_split(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    """KV tiles a split of a seq_len context takes: the split kernel's cut (its _program_rows) and the combine's
    knowledge of which splits wrote a partial (split s did iff s * tiles * BLOCK_N < seq_len)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits), MIN_SPLIT_TILES)


@triton.jit(do_not_specialize=["H", "num_splits"])
def _mla_decode_combine_kernel(
    PartO,
    PartLse,
    Out,
    SeqLens,
    stride_ot,
    stride_oh,
    stride_or,
    H,
    num_splits,
    R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    Q_LEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Out[t, h, r-block] = sum_s 2^(lse_s - max) PartO[t, h, s, r-block] / sum_s 2^(lse_s - max). All splits are
    loaded as one [BLOCK_S, BLOCK_R] tile: one memory round trip, not a chain of 2 * num_splits dependent loads.
    The splits that wrote a partial output (a non-empty token range) follow from the step's seq_lens, as the split
    kernel's _program_rows cuts them (Q_LEN, BLOCK_N, MIN_SPLIT_TILES are its): known before the PDL wait, so the
    partials load with the lse, not one round trip after it."""
    pdl_release(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    th = t.to(tl.int64) * H + h
    offs_s = tl.arange(0, BLOCK_S)
    seq_len = tl.load(SeqLens + t // Q_LEN)  # a step input: before the wait
    tiles_per_split = _tiles_per_split(seq_len, num_splits, BLOCK_N, MIN_SPLIT_TILES)
    filled = (offs_s < num_splits) & (offs_s * tiles_per_split * BLOCK_N < seq_len)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    pdl_wait(PDL)
    lse = tl.load(PartLse + th * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    part = tl.load(
        PartO + (th * num_splits + offs_s)[:, None] * R + offs_r[None, :], mask=filled[:, None], other=0.0
    ).to(tl.float32)
    has = lse > float("-inf")  # rows a split saw no key of (and empty splits, which never wrote their partial)
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no visible key at all (seq_len 0): zeros
    w = tl.where(has, tl.exp2(lse - lse_max), 0.0)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    part = tl.where(has[:, None], part, 0.0)
    o = tl.sum(part * w[:, None], 0) / denom
    o_ptr = Out + t.to(tl.int64) * stride_ot + h * stride_oh + offs_r * stride_or
    tl.store(o_ptr, o.to(Out.dtype.element_ty))
