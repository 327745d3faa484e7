"""The absorbed projections' few-token kernel (head_gemv) against torch.bmm in fp32 under the interpreter: both
weight layouts the model uses (w_kc and the transposed w_vc view of one kv_b_proj weight), outputs written into
strided views of caller-owned, NaN-poisoned buffers, 1-2 tokens."""

import pytest
import torch

from tests.kernel_checks import assert_close


def _views(kdev, dtype, H=4, N=16, V=8, R=32):
    w = torch.randn(H * (N + V), R, device=kdev).to(dtype)  # kv_b_proj.weight [H*(N+V), R]
    w_kc = w.view(H, N + V, R)[:, :N]  # [H, N, R]
    w_vc = w.view(H, N + V, R)[:, N:].transpose(1, 2)  # [H, R, V], R the unit-stride dim
    return w_kc, w_vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2])
def test_head_gemv_absorb_q_into_view(kdev, dtype, T):
    from mlaserve.kernels.head_gemv import head_gemv

    w_kc, _ = _views(kdev, dtype)
    H, N, R = w_kc.shape
    q = torch.randn(T, H, N + 8, device=kdev).to(dtype)  # q_nope is q[..., :N], a strided view
    Q = torch.full((T, H, R + 8), float("nan"), device=kdev, dtype=dtype)
    assert head_gemv(q[..., :N], w_kc, Q[..., :R]).data_ptr() == Q.data_ptr()
    ref = torch.bmm(q[..., :N].float().transpose(0, 1), w_kc.float()).transpose(0, 1)
    assert_close(Q[..., :R], ref, dtype, f"absorb_q T={T}")
    assert Q[..., R:].isnan().all()  # RoPE's part untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,cfg", [(1, None), (2, None), (2, dict(BLOCK_N=2, num_warps=1))])
def test_head_gemv_absorb_out_into_view(kdev, dtype, T, cfg):
    from mlaserve.kernels.head_gemv import head_gemv

    _, w_vc = _views(kdev, dtype)
    H, R, V = w_vc.shape
    o_lat = torch.randn(T, H, R, device=kdev).to(dtype)
    out = torch.full((T, H * V), float("nan"), device=kdev, dtype=dtype)
    head_gemv(o_lat, w_vc, out.view(T, H, V), cfg)
    ref = torch.bmm(o_lat.float().transpose(0, 1), w_vc.float()).transpose(0, 1).reshape(T, H * V)
    assert_close(out, ref, dtype, f"absorb_out T={T} {cfg}")


def test_head_gemv_checks(kdev):
    from mlaserve.kernels.head_gemv import head_gemv

    w_kc, _ = _views(kdev, torch.float32)
    H, N, R = w_kc.shape
    with pytest.raises(ValueError, match="1..2 tokens"):
        head_gemv(torch.randn(3, H, N, device=kdev), w_kc, torch.empty(3, H, R, device=kdev))
    with pytest.raises(ValueError, match=r"\[T, H, K\]"):
        head_gemv(torch.randn(1, H, N + 1, device=kdev), w_kc, torch.empty(1, H, R, device=kdev))
    with pytest.raises(ValueError, match="one dtype"):
        head_gemv(torch.randn(1, H, N, device=kdev).double(), w_kc, torch.empty(1, H, R, device=kdev))
