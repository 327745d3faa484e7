"""The tensor-core INT4 GEMV's inline PTX (kernels/int4_mma.py) on the GPU against tests/interp_mma.py's model of
it, on random registers: if they agree, the interpreter tests of the MMA form check what the GPU computes. Run:
PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_int4_mma_gpu.py"""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_seed")]


def _probe():
    import triton
    import triton.language as tl

    from mlaserve.kernels import int4_mma

    # the kernel's globals (Triton resolves names there, not in this closure)
    globals().update(
        {k: getattr(int4_mma, k) for k in ("PREP_ASM", "PREP_CONSTRAINTS", "XSUM_ASM", "XSUM_CONSTRAINTS")}
    )
    globals()["_mma"] = int4_mma._mma

    @triton.jit
    def probe(Wt, Wb, Y, XB, XS, S, Acc, OutP, OutS, OutA, MUL: tl.constexpr):
        v = tl.arange(0, 128)[None, :]
        y = tl.load(Y + v)
        tl.store(OutP + v, tl.inline_asm_elementwise(PREP_ASM, PREP_CONSTRAINTS, [y], tl.int32, True, 4))  # noqa: F821
        b0, b1 = tl.load(XB + v), tl.load(XB + 128 + v)
        b2, b3 = tl.load(XB + 256 + v), tl.load(XB + 384 + v)
        xs = tl.inline_asm_elementwise(XSUM_ASM, XSUM_CONSTRAINTS, [b0, b1, b2, b3], tl.float32, True, 4)  # noqa: F821
        tl.store(OutS + v, xs)
        wt, wb = tl.load(Wt + v), tl.load(Wb + v)
        st, sb = tl.load(S + v), tl.load(S + 128 + v)
        xs, acc = tl.load(XS + v), tl.load(Acc + v)
        acc = _mma(wt, wb, st, sb, b0, b1, b2, b3, xs, acc, MUL)  # noqa: F821
        tl.store(OutA + v, acc)

    return probe


def _bf16_bits(n):
    return torch.randn(n).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF


@pytest.mark.parametrize("mul", [False, True])
def test_mma_ptx_matches_the_model(mul):
    from mlaserve.kernels.int4_mma import MAIN_ASM, MAIN_ASM_MUL, PREP_ASM, XSUM_ASM, check_layout
    from tests.interp_mma import _to_regs, run_ptx

    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31, (2, 128), generator=g, dtype=torch.int64).to(torch.int32)
    y = _bf16_bits(128) | (_bf16_bits(128) << 16)
    xb = _bf16_bits(512) | (_bf16_bits(512) << 16)
    xs, acc = torch.randn(128), torch.randn(128)
    s = (torch.rand(256) + 0.5).to(torch.bfloat16)
    dev = [t.cuda() for t in (words[0], words[1], y, xb, xs, s, acc)]
    outs = [torch.empty(128, dtype=dt, device="cuda") for dt in (torch.int32, torch.float32, torch.float32)]
    k = _probe()[(1,)](*dev, *outs, MUL=mul, num_warps=1)
    check_layout(k, 1)

    def regs(t, bits=32):
        return _to_regs(t.numpy().reshape(1, -1), bits)

    def zeros():
        return [np.zeros((1, 32), np.uint32)] * 4

    def back(r, dtype):
        return np.stack(r, -1).reshape(-1).view(dtype)

    want_p = back(run_ptx(PREP_ASM.value, zeros() + regs(y), 4), np.int32)
    assert np.array_equal(outs[0].cpu().numpy(), want_p), "prmt"
    xbr = [r for i in range(4) for r in regs(xb[128 * i : 128 * (i + 1)])]
    want_s = back(run_ptx(XSUM_ASM.value, zeros() + xbr, 4), np.float32)
    np.testing.assert_allclose(outs[1].cpu().numpy(), want_s, rtol=1e-5, atol=1e-3)
    ops = zeros() + regs(words[0]) + regs(words[1]) + xbr + regs(xs) + regs(s[:128].view(torch.int16), 16)
    ops += regs(s[128:].view(torch.int16), 16) + regs(acc)
    want_a = back(run_ptx((MAIN_ASM_MUL if mul else MAIN_ASM).value, ops, 4), np.float32)
    np.testing.assert_allclose(outs[2].cpu().numpy(), want_a, rtol=1e-5, atol=1e-2)
