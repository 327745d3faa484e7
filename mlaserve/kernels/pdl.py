"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the kernel before it in
the stream is still running. In decode (and inside CUDA graphs) the ~20 small kernels of a layer otherwise each
pay a launch gap of about a microsecond, and a GEMV streams nothing until its predecessor has fully drained.

The contract every kernel launched with `launch_pdl=pdl(x)` keeps: it calls `pdl_start(PDL)` before it loads or
stores anything an earlier kernel writes or reads (activations, caches, outputs, buffers the allocator may
recycle). `pdl_start` waits for the previous grid to finish and flush (griddepcontrol.wait, so by induction all
earlier ones), then lets the next kernel launch early (griddepcontrol.launch_dependents). Before it a kernel may
only touch memory nobody writes during a forward: weights (gemv prefetches its weight rows into L2 there).
The dependent kernel's programs only start once every program of this one has started, so a many-wave kernel
is never crowded out by the next one. Kernels launched without PDL (cuBLAS, torch) keep full stream order.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl(t: torch.Tensor) -> bool:
    """Launch the kernels that work on `t` with PDL: CUDA sm_90+, compiled (not the Triton interpreter), and not
    turned off by MLASERVE_PDL=0. MLASERVE_PDL=force says yes for any tensor (compile_check builds the sm_90
    kernels from CPU tensors)."""
    mode = os.environ.get("MLASERVE_PDL", "1")
    if mode == "force":
        return True
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" or mode == "0":
        return False
    return _sm90(t.device.index if t.device.index is not None else torch.cuda.current_device())


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Wait for the previous kernel (and so every earlier one) to finish, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, PDL: tl.constexpr):
    """Pull the 128-byte lines at `ptrs` into L2 without waiting for them (weights, before pdl_start)."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
