"""What the engine's CUDA graphs and the EAGLE3 draft's share: the padded decode batch sizes they capture, and a
pause of Python's cyclic GC around a capture."""

from __future__ import annotations

import contextlib
import gc

DECODE_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


@contextlib.contextmanager
def gc_paused(on: bool = True):
    """Python's cyclic GC off while graphs are captured, after a full collection. A dead engine left in a reference
    cycle (an earlier LLM in the same process) still owns CUDA graphs; if the GC frees them mid-capture, their
    destruction (CUDAGraph.reset, its pool's memory) is a CUDA call that global-mode capture forbids, and the capture
    fails at its next launch. Seen in the gpu suite: "operation not permitted when stream is capturing (function
    reset)" warnings, then cuBLAS's next launch failing (docs/kernels.md, moe_gemv). on=False: nothing (no graphs)."""
    if not on:
        yield
        return
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
