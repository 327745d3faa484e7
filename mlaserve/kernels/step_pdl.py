"""Whether the launches of the running step may use PDL (kernels/pdl.py): the runner says so per step, from the
step's size (KernelConfig.pdl_max_tokens), around its forward and around the capture of its CUDA graph.

Kept apart from pdl.py, which defines Triton functions: the engine imports this at module level, and a Triton
function is fixed as interpreted or compiled when its module is first imported (tests/kernels_interp/conftest.py).
"""

from __future__ import annotations

import contextlib
import contextvars

_STEP_PDL = contextvars.ContextVar("mlaserve_step_pdl", default=True)


@contextlib.contextmanager
def step_pdl(on: bool):
    """The launches inside (a step's forward, or a graph's capture) use PDL only if `on`."""
    token = _STEP_PDL.set(on)
    try:
        yield
    finally:
        _STEP_PDL.reset(token)


def step_pdl_on() -> bool:
    return _STEP_PDL.get()
