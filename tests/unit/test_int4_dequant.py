"""compressed-tensors `pack-quantized` int4 experts (Kimi-K2.5's layout) dequantize on load, exactly."""

import re

import pytest
import torch

from mlaserve.models.weights import CheckpointError, dequant_int4_packed
from tests.model import ckpt_edit
from tests.model.helpers import load_model, make_tiny

GROUP = 16  # the tiny experts have 32/64 inputs; Kimi uses 32


def quantize_pack(w: torch.Tensor, group: int = GROUP):
    """w [out, in] -> (packed int32 [out, in/8], scale [out, in/group], q int [-8, 7]), written independently:
    value i of each int32 at bits 4i, stored with an offset of 8."""
    out_f, in_f = w.shape
    scale = w.view(out_f, in_f // group, group).abs().amax(-1) / 7 + 1e-8
    q = torch.round(w / scale.repeat_interleave(group, 1)).clamp(-8, 7).to(torch.int32)
    u = (q + 8).view(out_f, in_f // 8, 8)
    packed = torch.zeros(out_f, in_f // 8, dtype=torch.int64)
    for i in range(8):
        packed |= u[..., i].to(torch.int64) << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # as int32 bits
    return packed, scale, q


def test_dequant_matches_reference():
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    packed, scale, q = quantize_pack(w)
    got = dequant_int4_packed(packed, scale, (24, 64), torch.float32)
    assert torch.equal(got, q.float() * scale.repeat_interleave(GROUP, 1))
    assert (got - w).abs().max() <= scale.max() / 2 + 1e-6


def test_int4_experts_load_like_dense(tmp_path):
    q4 = make_tiny(tmp_path / "int4")
    dense = make_tiny(tmp_path / "dense")
    expert = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
    tensors = ckpt_edit.load_all(q4)
    deq = {}
    for key in [k for k in tensors if expert.match(k)]:
        packed, scale, q = quantize_pack(tensors[key])
        base = key[: -len("weight")]
        ckpt_edit.edit_shard(
            q4,
            key,
            lambda t, k=key, b=base, p=packed, s=scale: (
                t.pop(k),
                t.update(
                    {
                        b + "weight_packed": p,
                        b + "weight_scale": s.to(torch.bfloat16),
                        b + "weight_shape": torch.tensor(list(tensors[k].shape)),
                    }
                ),
            ),
        )
        deq[key] = dequant_int4_packed(packed, scale.to(torch.bfloat16), tuple(tensors[key].shape), torch.float32)
    for key, t in deq.items():
        ckpt_edit.edit_shard(dense, key, lambda ts, k=key, v=t: ts.update({k: v}))
    a, b = load_model(q4), load_model(dense)
    for (n, p), (_, r) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, r), n


def test_asymmetric_int4_refused(tmp_path):
    q4 = make_tiny(tmp_path / "asym")
    key = "model.layers.1.mlp.experts.0.gate_proj.weight"
    w = ckpt_edit.load_all(q4)[key]
    packed, scale, _ = quantize_pack(w)
    base = key[: -len("weight")]
    ckpt_edit.edit_shard(
        q4,
        key,
        lambda t: (
            t.pop(key),
            t.update(
                {
                    base + "weight_packed": packed,
                    base + "weight_scale": scale,
                    base + "weight_shape": torch.tensor(list(w.shape)),
                    base + "weight_zero_point": torch.zeros(w.shape[0], 1, dtype=torch.int32),
                }
            ),
        ),
    )
    with pytest.raises(CheckpointError, match="asymmetric"):
        load_model(q4)
