"""Arrival counters: the last of a group of programs finds out that it is last, and finishes the group's work.

A split kernel followed by a reduce kernel (split-K partials, then their sum) pays a second launch and a second
cold start in a batch-1 decode step. Instead, each program of a group stores its partial, then increments the
group's counter; the program that takes it to n - 1 -> n knows every other partial is written and visible, reduces
them, and resets the counter to 0 for the next launch. No program ever waits, so no co-residency is assumed.

Memory order: the CTA barrier orders every thread's partial stores before the arrival, which is a gpu-scope
acq_rel atomic (release: the stores happen-before it; acquire: the last program's later loads see every earlier
arrival's stores). The last program reads the partials with `.cg` loads (L2, never a stale L1 line).
Counters are int32 tensors that start at 0 (`arrival_counters`) and are left at 0 by every launch, so one buffer
serves every launch of a CUDA graph, in stream order (a kernel touches them only after its PDL wait).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def arrive_last(Counter, n):
    """Called once by every program of a group of n, after its partial stores: True in the last to arrive, which
    has also reset the counter to 0. Then read the partials with cache_modifier=".cg"."""
    tl.debug_barrier()  # every thread's stores are done before the arrival
    prev = tl.atomic_add(Counter, 1, sem="acq_rel", scope="gpu")
    last = prev == n - 1
    if last:
        tl.atomic_xchg(Counter, 0, sem="relaxed", scope="gpu")
    tl.debug_barrier()  # the whole program sees the acquire before its loads
    return last


def arrival_counters(n: int, device) -> torch.Tensor:
    """n zeroed counters for one kernel's groups; allocate once (outside graph capture) and reuse across launches."""
    return torch.zeros(n, dtype=torch.int32, device=device)
