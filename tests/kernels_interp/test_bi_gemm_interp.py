"""bi_gemm (deterministic mode's dense GEMM): each row bit for bit the same at M = 1, 3, 17, 64 (and a row's batch
entry alike in the batched form), close to the fp32 torch reference, every element of a NaN-poisoned output written."""

import pytest
import torch

from tests.helpers.kernel_checks import nan_like

MS = (1, 3, 17, 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K", [(48, 80), (64, 128)])
def test_rows_do_not_depend_on_m(kdev, dtype, N, K):
    from mlaserve.kernels.bi_gemm import bi_gemm

    x = torch.randn(max(MS), K, device=kdev).to(dtype)
    w = (torch.randn(N, K, device=kdev) / K**0.5).to(dtype)
    ref = x.float() @ w.float().t()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    outs = {}
    for M in MS:
        out = nan_like((M, N), dtype, kdev)
        bi_gemm(x[:M], w, out=out)
        assert (out.float() - ref[:M]).abs().max() <= tol * ref.abs().max(), M
        outs[M] = out
    for M in MS:
        assert torch.equal(outs[M], outs[max(MS)][:M]), M


def test_strided_views_and_fp32_out(kdev):
    """x a column slice, w a transposed view ([K, N] storage), out a strided view; out_dtype float32 (the router)."""
    from mlaserve.kernels.bi_gemm import bi_gemm

    K, N = 64, 40
    big = torch.randn(17, K + 16, device=kdev).to(torch.bfloat16)
    x = big[:, 8 : 8 + K]
    wt = torch.randn(K, N, device=kdev).to(torch.bfloat16)
    w = wt.t()  # [N, K], strides (1, N)
    ref = x.float() @ w.float().t()
    y = bi_gemm(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and (y - ref).abs().max() <= 1e-2 * ref.abs().max()
    buf = nan_like((17, 2 * N), torch.bfloat16, kdev)
    bi_gemm(x, w, out=buf[:, ::2])
    assert torch.equal(buf[:, ::2], y.to(torch.bfloat16)) and buf[:, 1::2].isnan().all()
    assert torch.equal(bi_gemm(x[:3], w, out_dtype=torch.float32), y[:3])


def test_batched_per_head_rows_do_not_depend_on_t(kdev):
    """The absorbed projections' form: x [H, T, K] @ m [H, K, N] into a [T, H, N] view transposed."""
    from mlaserve.kernels.bi_gemm import bi_gemm

    H, K, N, T = 3, 32, 48, 17
    q = torch.randn(T, H, K, device=kdev).to(torch.bfloat16)
    m = (torch.randn(H, K, N, device=kdev) / K**0.5).to(torch.bfloat16)
    ref = torch.bmm(q.float().transpose(0, 1), m.float()).transpose(0, 1)  # [T, H, N]
    outs = {}
    for t in (1, 3, T):
        out = nan_like((t, H, N), torch.bfloat16, kdev)
        bi_gemm(q[:t].transpose(0, 1), m.transpose(1, 2), out=out.transpose(0, 1))
        assert (out.float() - ref[:t]).abs().max() <= 1e-2 * ref.abs().max()
        outs[t] = out
    assert torch.equal(outs[1], outs[T][:1]) and torch.equal(outs[3], outs[T][:3])


def test_bad_input_names_field(kdev):
    from mlaserve.kernels.bi_gemm import bi_gemm

    x = torch.zeros(2, 16, device=kdev)
    with pytest.raises(ValueError, match="bi_gemm: w"):
        bi_gemm(x, torch.zeros(8, 32, device=kdev))
    with pytest.raises(ValueError, match="bi_gemm: x"):
        bi_gemm(x, torch.zeros(8, 16, device=kdev, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bi_gemm: out"):
        bi_gemm(x, torch.zeros(8, 16, device=kdev), out=torch.empty(2, 9, device=kdev))
