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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_rows_and_out(kdev, dtype):
    """rows: the norm of x[rows] (an embedding table's rows, any stride of the index), written into a strided
    view of a poisoned buffer; each row the bits of the whole-tensor call's row, the columns around it untouched."""
    from mlaserve.kernels.rmsnorm import add_rms_norm, rms_norm

    torch.manual_seed(3)
    D = 48
    table = torch.randn(11, D, device=kdev).to(dtype)
    w = torch.randn(D, device=kdev).to(dtype)
    ids = torch.tensor([[7, 0], [3, 1], [7, 2], [10, 3]], device=kdev)[:, 0]  # stride 2, a repeated id
    whole = rms_norm(table, w, 1e-6)
    buf = torch.full((4, 2 * D), float("nan"), device=kdev).to(dtype)
    got = rms_norm(table, w, 1e-6, rows=ids, out=buf[:, D:])
    assert got.data_ptr() == buf[:, D:].data_ptr()
    assert torch.equal(buf[:, D:], whole[ids]) and buf[:, :D].isnan().all()
    x = torch.randn(6, D, device=kdev).to(dtype)
    res = torch.randn(6, D + 4, device=kdev).to(dtype)[:, :D]  # strided residual
    rows = torch.tensor([5, 2, 2], device=kdev)
    o_all, s_all = add_rms_norm(x, res, w, 1e-6)
    o, s = add_rms_norm(x, res, w, 1e-6, rows=rows)
    assert o.shape == (3, D) and torch.equal(o, o_all[rows]) and torch.equal(s, s_all[rows])
    # the module's torch form (CPU) gathers the same rows
    from mlaserve.layers.norm import RMSNorm

    norm = RMSNorm(D, 1e-6, dtype=dtype).to(kdev)
    norm.weight.data.copy_(w)
    o2, s2 = norm(x, res, rows=rows)
    o3, s3 = norm(x[rows], res[rows])
    assert torch.equal(o2, o3) and torch.equal(s2, s3)
    out = torch.full((4, D), float("nan"), device=kdev).to(dtype)
    assert norm(table, rows=ids, out=out) is out and torch.equal(out, norm(table[ids]))


def test_rmsnorm_rejects_bad_rows_and_out():
    pytest.importorskip("triton")
    from mlaserve.kernels.rmsnorm import rms_norm

    x, w = torch.zeros(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="rows"):
        rms_norm(x, w, 1e-6, rows=torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        rms_norm(x, w, 1e-6, rows=torch.zeros(2))
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, w, 1e-6, out=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, w, 1e-6, out=torch.zeros(8, 4).t())
