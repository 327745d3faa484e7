"""The MLA projection contract (docs/design.md §1): the absorbed projections write straight into caller-owned
buffers with one bmm each, and the absorbed path issues no copy, clone or contiguous op."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlaserve.attention.base import ForwardBatch, SeqChunk
from mlaserve.config import ModelConfig
from mlaserve.distributed.tp import RankInfo
from mlaserve.layers.rotary import RotaryEmbedding
from mlaserve.models.deepseek_v3 import DeepseekV3Attention
from mlaserve.models.make_random import load_preset

aten = torch.ops.aten
# Layout-only ops (no data movement) and allocation.
VIEW_OPS = {
    aten.view,
    aten._unsafe_view,
    aten.transpose,
    aten.slice,
    aten.select,
    aten.t,
    aten.expand,
    aten.unsqueeze,
    aten.squeeze,
    aten.as_strided,
    aten.alias,
    aten.detach,
    aten.empty,
    aten.new_empty,
}
COPY_OPS = {
    aten.copy_,
    aten.clone,
    aten._to_copy,
    aten.contiguous,
    aten.cat,
    aten.stack,
    aten.index_put_,
    aten.index,
    aten.reshape,
    aten.repeat,
    aten.masked_scatter,
}


class OpRecorder(TorchDispatchMode):
    """Records the overload packets of every aten op run while `self.on` is true."""

    def __init__(self):
        super().__init__()
        self.ops, self.on = [], True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.ops.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def attn(request):
    cfg = ModelConfig.from_hf(load_preset("tiny"))
    torch.manual_seed(0)
    a = DeepseekV3Attention(cfg, layer_id=0, ranks=RankInfo(), dtype=request.param)
    for p in a.parameters():
        p.data = torch.randn_like(p.float()).to(p.dtype) / p.shape[-1] ** 0.5
    return a


def nan_like(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def test_absorb_q_writes_into_callers_buffer_with_one_bmm(attn):
    T, H, N, P, R = 5, attn.H, attn.N, attn.P, attn.R
    dtype = attn.kv_b_proj.weight.dtype
    q = torch.randn(T, H, N + P, dtype=dtype)  # q_nope is the strided view q[..., :N]
    Q = nan_like((T, H, R + P), dtype)
    ptr = Q.data_ptr()
    with OpRecorder() as rec:
        attn.absorb_q(q[..., :N], Q)
    assert aten.bmm in rec.ops
    assert set(rec.ops) <= VIEW_OPS | {aten.bmm}, set(rec.ops) - VIEW_OPS
    assert rec.ops.count(aten.bmm) == 1
    assert Q.data_ptr() == ptr
    assert torch.isfinite(Q[..., :R]).all()  # every element written
    assert torch.isnan(Q[..., R:]).all()  # the rope part left to RoPE
    ref = torch.einsum("thn,hnr->thr", q[..., :N].float(), attn.w_kc.float())
    torch.testing.assert_close(Q[..., :R].float(), ref, **tol(dtype))


def test_absorb_out_writes_into_callers_buffer_with_one_bmm(attn):
    T, H, R, V = 5, attn.H, attn.R, attn.V
    dtype = attn.kv_b_proj.weight.dtype
    o_lat = torch.randn(T, H, R, dtype=dtype)
    out = nan_like((T, H * V), dtype)
    ptr = out.data_ptr()
    with OpRecorder() as rec:
        attn.absorb_out(o_lat, out)
    assert set(rec.ops) <= VIEW_OPS | {aten.bmm}, set(rec.ops) - VIEW_OPS
    assert rec.ops.count(aten.bmm) == 1
    assert out.data_ptr() == ptr and torch.isfinite(out).all()
    ref = torch.einsum("thr,hrv->thv", o_lat.float(), attn.w_vc.float()).reshape(T, H * V)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


def test_absorb_out_into_a_row_slice_of_a_larger_buffer(attn):
    """forward() hands the absorbed path out[:Td] of a [T, H*V] buffer that prefill rows share."""
    T, Td, H, R, V = 7, 3, attn.H, attn.R, attn.V
    dtype = attn.kv_b_proj.weight.dtype
    out = nan_like((T, H * V), dtype)
    attn.absorb_out(torch.randn(Td, H, R, dtype=dtype), out[:Td])
    assert torch.isfinite(out[:Td]).all() and torch.isnan(out[Td:]).all()


class FakeBackend:
    """Stands in for the attention backend: records what decode() got, writes a known o_lat into its out."""

    def __init__(self, o_lat, rec):
        self.o_lat, self.rec = o_lat, rec

    def absorb_q_rope(self, q, w_kc, cos, sin, Q):  # no one-launch form: the model runs absorb_q and rope_q
        return False

    def rope_q(self, x, cos, sin, out):  # the reference RoPE writes Q[..., R:] with out= (recorded)
        from mlaserve.layers.rotary import apply_rope

        return apply_rope(x, cos, sin, out=out)

    def decode(self, layer_id, q, scale, batch, out):
        self.rec.on = False  # the backend's own ops are not under test here
        self.q, self.out_ptr = q.clone(), out.data_ptr()
        out.copy_(self.o_lat)
        self.rec.on = True
        return out


def test_forward_absorbed_issues_no_copies(attn):
    """forward_absorbed minus the backend: absorb_q, RoPE into Q[..., R:], absorb_out. In fp32 nothing is
    copied; in bf16 RoPE's upcast of q_pe (`.float()`) is the only conversion."""
    T, H, N, P, R, V = 4, attn.H, attn.N, attn.P, attn.R, attn.V
    dtype = attn.kv_b_proj.weight.dtype
    q = torch.randn(T, H, N + P, dtype=dtype)
    rotary = RotaryEmbedding(ModelConfig.from_hf(load_preset("tiny")).rope, P)
    cos, sin = rotary(torch.arange(10, 10 + T))
    batch = ForwardBatch.build([SeqChunk([0], 10, [0, 1, 2]) for _ in range(T)], [], 4, "cpu")
    out = nan_like((T, H * V), dtype)
    rec = OpRecorder()
    batch.attn = FakeBackend(torch.randn(T, H, R, dtype=dtype), rec)
    with rec:
        attn.forward_absorbed(q, cos, sin, batch, out)
    copies = set(rec.ops) & COPY_OPS
    assert copies <= ({aten._to_copy} if dtype == torch.bfloat16 else set()), copies
    assert rec.ops.count(aten.bmm) == 2

    # What reached the backend: Q = [q_nope @ w_kc | rope(q_pe)]; the result landed in `out`.
    Q = batch.attn.q
    torch.testing.assert_close(
        Q[..., :R].float(), torch.einsum("thn,hnr->thr", q[..., :N].float(), attn.w_kc.float()), **tol(dtype)
    )
    x0, x1 = q[..., N::2].float(), q[..., N + 1 :: 2].float()
    c, s = cos[:, None], sin[:, None]
    torch.testing.assert_close(Q[..., R::2].float(), x0 * c - x1 * s, **tol(dtype))
    torch.testing.assert_close(Q[..., R + 1 :: 2].float(), x1 * c + x0 * s, **tol(dtype))
    assert torch.isfinite(out).all()
    ref = torch.einsum("thr,hrv->thv", batch.attn.o_lat.float(), attn.w_vc.float()).reshape(T, H * V)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def test_recorder_catches_the_copying_form(attn):
    """The check is not vacuous: the form the contract replaced (contiguous input, temporary output, copy
    back) shows its clone and copy_."""
    T, H, N, P, R = 5, attn.H, attn.N, attn.P, attn.R
    dtype = attn.kv_b_proj.weight.dtype
    q, Q = torch.randn(T, H, N + P, dtype=dtype), nan_like((T, H, R + P), dtype)
    with OpRecorder() as rec:
        Q[..., :R] = torch.bmm(q[..., :N].transpose(0, 1).contiguous(), attn.w_kc).transpose(0, 1)
    assert {aten.clone, aten.copy_} <= set(rec.ops)
