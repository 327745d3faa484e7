"""MLA decode's combine of split partials: out = sum_s 2^(lse_s - max) PartO_s / sum_s 2^(lse_s - max).

`_mla_decode_combine_kernel`, launched by mla_decode after its split kernel, reads the partials (PartO [T, H, S, R],
PartLse [T, H, S]): all splits of a (token, head, R block) as one tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_start

COMBINE_TILE = 8192  # elements of the combine's [splits, BLOCK_R] fp32 tile (4 warps)


@triton.jit(do_not_specialize=["H", "num_splits"])
def _mla_decode_combine_kernel(
    PartO, PartLse, Out,
    stride_ot, stride_oh, stride_or,
    H, num_splits,
    R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    """Out[t, h, r-block] = sum_s 2^(lse_s - max) PartO[t, h, s, r-block] / sum_s 2^(lse_s - max). All splits are
    loaded as one [BLOCK_S, BLOCK_R] tile: one memory round trip, not a chain of 2 * num_splits dependent loads."""
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    th = t.to(tl.int64) * H + h
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(PartLse + th * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    has = lse > float("-inf")  # empty splits never wrote their partial output
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no visible key at all (seq_len 0): zeros
    w = tl.where(has, tl.exp2(lse - lse_max), 0.0)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    part = tl.load(PartO + (th * num_splits + offs_s)[:, None] * R + offs_r[None, :], mask=has[:, None],
                   other=0.0).to(tl.float32)
    o = tl.sum(part * w[:, None], 0) / denom
    o_ptr = Out + t.to(tl.int64) * stride_ot + h * stride_oh + offs_r * stride_or
    tl.store(o_ptr, o.to(Out.dtype.element_ty))
