"""Programmatic dependent launch (PDL, Hopper and later): a kernel is launched while the one before it still runs.

A batch-1 decode step is a dependent chain of ~400 short kernels, and each pays a launch gap plus a cold start
(~1-2 us on the H200, docs/experiments.md). With PDL every kernel of ours releases its dependents as it starts
(`griddepcontrol.launch_dependents`), so the next kernel's programs are already resident when it ends; they may
load what no kernel writes (weights) and then block in `griddepcontrol.wait` until every grid they depend on has
finished and its writes are visible.

The rule that makes this safe, kept by every kernel launched with `pdl_args`: before `pdl_wait` it reads only
weights and the step's inputs that were copied from the host before the forward (seq_lens, page table, slot
mapping: written by no kernel of the step; data written by any kernel, however early in the step, is not safe,
since a programmatic edge does not flush its writes before the wait), and writes nothing. A kernel passes its wait
only once its predecessors finished, and they passed their own waits, so everything launched before it has
finished. Kernels launched without PDL (cuBLAS, torch) wait for their predecessors in full, as always.

One amendment, for a kernel whose predecessor releases it only after passing its own wait (the MoE's GEMM1, which
releases GEMM2): everything launched before that predecessor had finished when the kernel launched, so the kernel
may also read those kernels' outputs before its wait, through L2 (`.cg` loads: an SM's L1 may hold stale lines of
a reused buffer). GEMM2 reads the routing that way, and fetches its first weight tile with it (fused_moe.py).

Whether a kernel launches with PDL is its caller's `pdl` argument (KernelConfig.pdl; MLASERVE_PDL=0 turns it
off, for A/B timing); pdl_args adds what the device decides.

Tensor parallelism runs with it too (every rank runs rank 0's KernelConfig): the rule holds around collectives by
construction. NCCL's kernels and the symmetric-memory all-reduces (distributed/allreduce.py) are launched without
PDL, so they start only once the kernel before them has finished; and they never release their dependents early,
so the kernel after one starts only as its last block exits, and reads its output after its wait. TP2 under CUDA
graphs with PDL on every rank gives one GPU's greedy tokens on two H200s (tests/gpu/test_tp_graphs_gpu.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_args(t: torch.Tensor, pdl: bool = True) -> dict:
    """Launch kwargs for a kernel with a `PDL: tl.constexpr` parameter, running on t's device: PDL when the caller
    asks for it (KernelConfig.pdl) and the device has it (sm_90+)."""
    on = pdl and t.is_cuda and _has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel launch now (its programs take free SM slots and wait there)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the kernels this one depends on have finished and their writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Release, then wait: the prologue of a kernel with nothing to load before its inputs are ready."""
    pdl_release(PDL)
    pdl_wait(PDL)
