"""The absorbed projections' few-token kernel (head_gemv) against torch.bmm in fp32 under the interpreter: both
weight layouts the model uses (w_kc and the transposed w_vc view of one kv_b_proj weight), outputs written into
strided views of caller-owned, NaN-poisoned buffers, 1-2 tokens; and absorb_q_rope (the absorption and the query's
RoPE in one launch) against head_gemv + rope_q (bit for bit) and the torch references."""

import pytest
import torch

from tests.helpers.kernel_checks import assert_close


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


def _cos_sin(kdev, T, P, first_pos):
    """cos/sin [T, P/2] fp32 as the model makes them (layers.rotary, YaRN as DeepSeek-V3 configures it)."""
    from mlaserve.config import RopeConfig
    from mlaserve.layers.rotary import RotaryEmbedding

    rope = RopeConfig(theta=10000.0, type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    cos, sin = RotaryEmbedding(rope, P)(torch.arange(first_pos, first_pos + T))
    return cos.to(kdev), sin.to(kdev)


def _check_absorb_q_rope(kdev, dtype, T, first_pos, H, N, R, P, V=8):
    """q is a view of the projection output (q_b_proj's, or linear_many's column view beside kv_a), Q the
    caller's NaN-poisoned [T, H, R+P]: one launch equals head_gemv then rope_q bit for bit, and the references."""
    from mlaserve.kernels.head_gemv import absorb_q_rope, head_gemv
    from mlaserve.kernels.rope_kv import rope_q
    from tests.helpers.kernel_refs import rope_q_ref

    w_kc, _ = _views(kdev, dtype, H=H, N=N, V=V, R=R)
    proj = torch.randn(T, H * (N + P) + R + P, device=kdev).to(dtype)  # [q | kv_a] of one GEMM
    q = proj[:, : H * (N + P)].view(T, H, N + P)
    cos, sin = _cos_sin(kdev, T, P, first_pos)
    Q = torch.full((T, H, R + P), float("nan"), device=kdev, dtype=dtype)
    assert absorb_q_rope(q, w_kc, cos, sin, Q) is Q
    two = torch.full_like(Q, float("nan"))
    head_gemv(q[..., :N], w_kc, two[..., :R])
    rope_q(q[..., N:], cos, sin, two[..., R:])
    what = f"absorb_q_rope T={T} pos={first_pos} {dtype}"
    assert not Q.isnan().any(), what
    assert torch.equal(Q, two), f"{what}: differs from head_gemv + rope_q"
    ref_q = torch.bmm(q[..., :N].float().transpose(0, 1), w_kc.float()).transpose(0, 1)
    assert_close(Q[..., :R], ref_q, dtype, what + " absorb")
    assert_close(Q[..., R:], rope_q_ref(q[..., N:], cos, sin), dtype, what + " rope")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("first_pos", [0, 37, 5000])
def test_absorb_q_rope_equals_head_gemv_then_rope_q(kdev, dtype, T, first_pos):
    _check_absorb_q_rope(kdev, dtype, T, first_pos, H=4, N=16, R=32, P=8)


@pytest.mark.parametrize("T", [1, 2])
def test_absorb_q_rope_model_head_dims(kdev, T):
    # N=128, R=512, P=64 as every DeepSeek-V3-family model has them (the default BLOCK_N=32 tiles), two heads
    _check_absorb_q_rope(kdev, torch.bfloat16, T, 4095, H=2, N=128, R=512, P=64, V=128)


def test_absorb_q_rope_checks(kdev):
    from mlaserve.kernels.head_gemv import absorb_q_rope

    w_kc, _ = _views(kdev, torch.float32)
    H, N, R = w_kc.shape
    P = 8
    cos, sin = _cos_sin(kdev, 1, P, 0)
    q, Q = torch.randn(1, H, N + P, device=kdev), torch.empty(1, H, R + P, device=kdev)
    with pytest.raises(ValueError, match="1..2 tokens"):
        absorb_q_rope(torch.randn(3, H, N + P, device=kdev), w_kc, cos, sin, torch.empty(3, H, R + P, device=kdev))
    with pytest.raises(ValueError, match=r"\[T, H, R\+P\]"):
        absorb_q_rope(q, w_kc, cos, sin, torch.empty(1, H, R + P + 2, device=kdev))
    with pytest.raises(ValueError, match="P > 0 even"):
        absorb_q_rope(torch.randn(1, H, N + 7, device=kdev), w_kc, cos, sin, torch.empty(1, H, R + 7, device=kdev))
    with pytest.raises(ValueError, match=r"\[H, N, R\]"):
        absorb_q_rope(q, w_kc[0], cos, sin, Q)
    with pytest.raises(ValueError, match="cos/sin must be fp32"):
        absorb_q_rope(q, w_kc, cos.double(), sin, Q)
    with pytest.raises(ValueError, match="cos/sin must be fp32"):
        absorb_q_rope(q, w_kc, cos[:, :2], sin[:, :2], Q)
    with pytest.raises(ValueError, match="one dtype"):
        absorb_q_rope(q.double(), w_kc, cos, sin, Q)
