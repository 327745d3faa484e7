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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [48, 2048])
def test_add_rmsnorm(kdev, dtype, D):
    """The fused residual add: the sum is bit-equal to `x + residual`, the norm equals the torch form of it."""
    from mlaserve.kernels.rmsnorm import add_rms_norm
    from mlaserve.layers.norm import RMSNorm

    torch.manual_seed(D + 1)
    x = torch.randn(5, D + 8, device=kdev).to(dtype)[:, :D]  # strided rows
    res = torch.randn(5, D, device=kdev).to(dtype)
    norm = RMSNorm(D, 1e-6, dtype=dtype).to(kdev)
    norm.weight.data.normal_(1.0, 0.1)
    out, s = add_rms_norm(x, res, norm.weight, 1e-6)
    # compiled: bit-equal to torch's add; the interpreter's fp32 -> bf16 cast may round differently (1 ulp)
    exact = kdev != "cpu" or dtype == torch.float32
    assert torch.equal(s, x + res) if exact else torch.allclose(s.float(), (x + res).float(), rtol=1e-2, atol=1e-2)
    h = (x + res).float()
    ref = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert not out.isnan().any()
    assert ((out.float() - ref.float()).norm() / ref.float().norm()) < tol
    # the module routes to the kernel on the GPU and to torch elsewhere; both give (norm(sum), sum)
    out2, s2 = norm(x, res)
    assert (torch.equal(s2, s) or not exact) and ((out2.float() - ref.float()).norm() / ref.float().norm()) < tol
