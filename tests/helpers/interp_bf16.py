"""Round fp32 -> bf16 casts to nearest even under the Triton interpreter, as compiled kernels do (triton 3.6's
interpreter truncates them), so bf16 checks under the interpreter measure the kernels and not the interpreter."""

import contextlib

import numpy as np


@contextlib.contextmanager
def bf16_round_to_nearest():
    import triton.language as tl
    from triton.runtime import interpreter as interp

    orig = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            b = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
            r = np.where(np.isnan(src.data), np.uint16(0x7FC0), r)
            return interp.TensorHandle(r.reshape(src.data.shape), dst_type.scalar)
        return orig(self, src, dst_type)

    interp.InterpreterBuilder.cast_impl = cast_impl
    try:
        yield
    finally:
        interp.InterpreterBuilder.cast_impl = orig
