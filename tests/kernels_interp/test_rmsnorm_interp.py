"""rms_norm (one kernel) equals layers.norm.RMSNorm's torch form: strided rows, NaN-poisoned output, any D."""

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 48, 2048])
def test_rmsnorm(kdev, dtype, D):
    from mlaserve.kernels.rmsnorm import rms_norm
    from mlaserve.layers.norm import RMSNorm

    torch.manual_seed(D)
    base = torch.randn(7, D + 8, device=kdev).to(dtype)
    x = base[:, :D]  # strided rows, like kv_a[:, :R]
    norm = RMSNorm(D, 1e-6, dtype=dtype).to(kdev)
    norm.weight.data.normal_(1.0, 0.1)
    h = x.float()
    ref = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out = rms_norm(x, norm.weight, 1e-6)
    assert not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((out.float() - ref.float()).norm() / ref.float().norm()) < tol
