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
