"""silu_mul (one kernel) equals F.silu(g) * u on column views of one gate|up GEMM output, NaN-poisoned around."""

import pytest
import torch
import torch.nn.functional as F


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("I", [24, 1408, 2100])
def test_silu_mul(kdev, dtype, I):
    from mlaserve.kernels.silu_mul import silu_mul

    torch.manual_seed(I)
    gu = torch.randn(6, 2 * I + 5, device=kdev).mul(3).to(dtype)
    gu[:, 2 * I :] = float("nan")  # a read past `up` would poison the output
    g, u = gu[:, :I], gu[:, I : 2 * I]
    out = silu_mul(g, u)
    ref = F.silu(g.float()).to(dtype).float() * u.float()
    assert not out.isnan().any()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert ((out.float() - ref).norm() / ref.norm()) < tol
    assert silu_mul(g[:0], u[:0]).shape == (0, I)


def test_silu_mul_rejects_bad_shapes(kdev):
    from mlaserve.kernels.silu_mul import silu_mul

    with pytest.raises(ValueError, match="gate"):
        silu_mul(torch.randn(2, 4, device=kdev), torch.randn(2, 5, device=kdev))


@pytest.mark.parametrize("T,I,align", [(5, 200, 4), (37, 384, 1), (16, 128, 4)])
def test_silu_mul_quant_equals_silu_mul_then_act_quant(kdev, T, I, align):
    """The fused form gives act_quant(silu_mul(g, u))'s bits, on column views of one gate|up output (NaN after up),
    into poisoned buffers, with padding rows q = 0; dequantized, near F.silu(g) * u."""
    from mlaserve.kernels.fp8_quant import act_quant
    from mlaserve.kernels.fp8_reference import fp8_act_dequant
    from mlaserve.kernels.silu_mul import silu_mul, silu_mul_quant
    from tests.helpers.kernel_checks import poisoned_empty

    torch.manual_seed(T * I)
    gu = torch.randn(T, 2 * I + 3, device=kdev).mul(3).to(torch.bfloat16)
    gu[:, 2 * I :] = float("nan")
    gu[2, :I] = 0  # a zero row: the amax floor's scale
    g, u = gu[:, :I], gu[:, I : 2 * I]
    with poisoned_empty():
        q, s = silu_mul_quant(g, u, row_align=align)
    Tp = -(-T // align) * align
    G = -(-I // 128)
    assert q.shape == (Tp, I) and s.shape == (Tp, G) and s.stride() == (1, Tp)
    qr, sr = act_quant(silu_mul(g, u), row_align=align)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    # against F.silu (whose exp may differ from the kernel's by an ulp on a GPU): within fp8's rounding
    ref = F.silu(g.float()).to(torch.bfloat16).float() * u.float()
    deq = fp8_act_dequant(q[:T], s[:T])
    assert (deq - ref).norm() / ref.norm() < 0.05
    assert not q[T:].view(torch.uint8).any()
