"""MLA decode's combine of split partials: out = sum_s 2^(lse_s - max) PartO_s / sum_s 2^(lse_s - max).

Two forms over the same partials (PartO [T, H, S, R], PartLse [T, H, S], written by mla_decode's split kernel):
- `_mla_decode_combine_kernel`, a second launch: all splits of a (token, head, R block) as one tile;
- `_combine_group`, run by the split kernel's last program of a (request, head block) (arrival counters,
  semaphore.py): the group's rows merged online over its used splits. Not bit-equal to the kernel (another
  summation order); deterministic (a fixed order over splits, whichever program runs it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_start

COMBINE_TILE = 8192  # elements of the combine's [splits, BLOCK_R] fp32 tile (4 warps)


@triton.jit
def _combine_group(PartO, PartLse, Out, t, h, row_ok, n_used, stride_ot, stride_oh, stride_or, H, num_splits,
                   R: tl.constexpr, BLOCK_M: tl.constexpr, COMBINE_R: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The last split program of a group: out = sum_s 2^(lse_s - max) PartO_s / sum_s 2^(lse_s - max) over its rows,
    merged online over the n_used non-empty splits (later ones were never written), in [M, COMBINE_R] chunks of R.
    Partials are read with .cg (L2): other programs wrote them. The pipeliner turns the 4-byte lse loads into
    cp.async.ca (L1); arrive_last's gpu-scope acquire invalidates this SM's L1 first (CCTL.IVALL in the SASS)."""
    th = t.to(tl.int64) * H + h  # [M]
    for r0 in tl.static_range(0, R, COMBINE_R):
        offs_r = r0 + tl.arange(0, COMBINE_R)
        m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_M], tl.float32)
        o = tl.zeros([BLOCK_M, COMBINE_R], tl.float32)
        for s in tl.range(0, n_used, num_stages=NUM_STAGES):
            # A used split wrote every valid row (zeros where it saw no key): the partial's load need not wait for
            # its lse, so both are one round trip.
            lse = tl.load(PartLse + th * num_splits + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(PartO + (th * num_splits + s)[:, None] * R + offs_r[None, :], mask=row_ok[:, None],
                           other=0.0, cache_modifier=".cg").to(tl.float32)
            has = lse > float("-inf")
            m_new = tl.maximum(m_run, lse)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: stay at 0
            alpha = tl.exp2(m_run - m_use)
            w = tl.where(has, tl.exp2(lse - m_use), 0.0)
            den = den * alpha + w
            o = o * alpha[:, None] + part * w[:, None]
            m_run = m_new
        o = o / tl.where(den > 0.0, den, 1.0)[:, None]  # seq_len 0 (no split used): zeros
        o_ptr = Out + t.to(tl.int64)[:, None] * stride_ot + h[:, None] * stride_oh + offs_r[None, :] * stride_or
        tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=row_ok[:, None])


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
