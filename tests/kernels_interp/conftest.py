"""Triton kernels under the interpreter: tiny shapes on CPU tensors (TRITON_INTERPRET=1).

Triton fixes interpreted-vs-compiled when a @triton.jit function is DEFINED, i.e. when mlaserve.kernels.* is first
imported. So, without CUDA, this conftest turns the interpreter on at import (pytest imports it before the test
modules beside it), and no test module anywhere imports mlaserve.kernels at module level (only inside tests).
With CUDA the same tiny tests run compiled on the GPU instead (the `kdev` fixture says where).
Run alone:  PYTHONPATH=$PWD python -m pytest -q tests/kernels_interp
Without triton installed every test here skips; the test extra installs it (pyproject.toml), so CI runs them.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_interpreter() -> None:
    """Five bugs of triton's interpreter (3.6 to 3.9, with numpy 2.x) that compiled kernels do not have:
    - tl.dot multiplies bf16 operands as their raw uint16 bits: widen them to fp32 first;
    - a scalar loaded from memory is a 1-element array, which numpy 2 refuses to turn into an int, so a loop
      `for i in range(start, end)` with loaded bounds fails: index the single element instead;
    - a cast to float8e4nv rounds half up and drops the carry when the mantissa rounds over (1.95 -> 1.0), and
      a cast from fp32 to bf16 truncates (a bias that adds up over sums of rounded terms): cast both through
      torch, which rounds to nearest even as the GPU's cvt.rn does;
    - a comparison's handle takes its operands' type (int32 for `start < end`) over bool data, so a scalar
      comparison broadcast into a block (`row_ok & (start < end)`) becomes int32 data: 3.6 to 3.8 load and store
      through such a mask, 3.9 refuses it ("mask has unsupported dtype"); type the handle int1, as the IR has it."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    if getattr(interp, "_mlaserve_patched", False):
        return
    orig_dot = interp.InterpreterBuilder.create_dot

    def widen(h):
        if str(h.dtype.scalar) != "bf16":
            return h
        return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    orig_patch_tensor = interp._patch_lang_tensor

    def patch_tensor(tensor, scope):
        orig_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    orig_fp_to_fp = interp.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if str(dst_type.scalar) != "fp8e4nv":
            return orig_fp_to_fp(self, src, dst_type, rounding_mode)
        wide = src if str(src.dtype.scalar) == "fp32" else orig_fp_to_fp(self, src, tl.float32, rounding_mode)
        q = torch.from_numpy(np.ascontiguousarray(wide.data, dtype=np.float32)).to(torch.float8_e4m3fn)
        return interp.TensorHandle(q.view(torch.uint8).numpy().reshape(np.shape(wide.data)), dst_type.scalar)

    orig_cast = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if str(src.dtype.scalar) != "fp32" or str(dst_type.scalar) != "bf16":
            return orig_cast(self, src, dst_type)
        b = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
        return interp.TensorHandle(b.view(torch.uint16).numpy().reshape(np.shape(src.data)), dst_type.scalar)

    def as_int1(cmp):
        return lambda self, lhs, rhs: interp.TensorHandle(cmp(self, lhs, rhs).data, tl.int1)

    for name in dir(interp.InterpreterBuilder):
        if name.startswith(("create_icmp", "create_fcmp")):
            setattr(interp.InterpreterBuilder, name, as_int1(getattr(interp.InterpreterBuilder, name)))
    interp.InterpreterBuilder.create_dot = create_dot
    interp.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    interp.InterpreterBuilder.cast_impl = cast_impl
    interp._patch_lang_tensor = patch_tensor
    interp._mlaserve_patched = True


@pytest.fixture(scope="session")
def kdev() -> str:
    """'cpu' when the kernels are interpreted, 'cuda' when compiled; skips when neither can run."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from mlaserve.kernels import mla_decode

    if isinstance(mla_decode._mla_decode_split_kernel, InterpretedFunction):
        _patch_interpreter()
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip(
        "mlaserve.kernels was imported before TRITON_INTERPRET=1 was set; run "
        "`python -m pytest tests/kernels_interp` in its own process"
    )


@pytest.fixture(autouse=True)
def _seed(request):
    """Random inputs, reproducible per test."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def two_shared_ckpt(tmp_path_factory):
    """tiny with two shared experts (as Moonlight has): the shared-experts fusion and the fused MoE sum + norm."""
    from mlaserve.models.make_random import make_random

    return make_random(
        "tiny",
        str(tmp_path_factory.mktemp("two_shared")),
        seed=2,
        dtype="float32",
        progress=False,
        overrides={"n_shared_experts": 2},
    )
