"""A test kernel for arrive_last (imported inside tests only: it needs triton, which CI lacks)."""

import triton
import triton.language as tl

from mlaserve.kernels.semaphore import arrive_last


@triton.jit
def group_sum(X, Part, Out, Cnt, S: tl.constexpr):
    """Out[g] = sum_s 2 * X[g, s], summed by the last program of group g from the partials of all S."""
    g = tl.program_id(0)
    s = tl.program_id(1)
    tl.store(Part + g * S + s, tl.load(X + g * S + s) * 2.0)
    if arrive_last(Cnt + g, S):
        tl.store(Out + g, tl.sum(tl.load(Part + g * S + tl.arange(0, S), cache_modifier=".cg"), 0))
