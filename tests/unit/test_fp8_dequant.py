"""FP8 e4m3 weights with 128x128 block scales (`weight_scale_inv`, DeepSeek-V3 / Kimi-K2) dequantize on load."""

import pytest
import torch

from mlaserve.models.weights import CheckpointError, dequant_fp8_block
from tests.model import ckpt_edit
from tests.model.helpers import load_model, make_tiny


def _fp8_works() -> bool:
    try:
        return torch.ones(2).to(torch.float8_e4m3fn).float().sum().item() == 2
    except (AttributeError, RuntimeError, TypeError):
        return False


pytestmark = pytest.mark.skipif(not _fp8_works(), reason="this torch has no CPU float8_e4m3fn")
BLOCK = 128


def quantize(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (fp8 weight, scale_inv [ceil(out/128), ceil(in/128)]) with a different scale per block."""
    shape = (-(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK))
    scale = 0.5 + torch.rand(shape, generator=gen)
    full = scale.repeat_interleave(BLOCK, 0)[: w.shape[0]].repeat_interleave(BLOCK, 1)[:, : w.shape[1]]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


def dequant_expected(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block by block, written independently of dequant_fp8_block."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_fp8_block(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    q, scale = quantize(torch.randn(shape, generator=gen), gen)
    got = dequant_fp8_block(q, scale, dtype)
    assert got.dtype == dtype and got.shape == shape
    torch.testing.assert_close(got, dequant_expected(q, scale).to(dtype), rtol=0, atol=0)


# Checkpoint keys quantized below, and where each lands in the model.
QUANTIZED = {
    "model.layers.0.self_attn.q_a_proj.weight": lambda m: m.model.layers[0].self_attn.q_a_proj.weight,
    "model.layers.0.self_attn.kv_b_proj.weight": lambda m: m.model.layers[0].self_attn.kv_b_proj.weight,
    "model.layers.0.mlp.up_proj.weight": lambda m: m.model.layers[0].mlp.up_proj.weight,
    "model.layers.0.mlp.down_proj.weight": lambda m: m.model.layers[0].mlp.down_proj.weight,
    "model.layers.1.mlp.experts.2.gate_proj.weight": lambda m: m.model.layers[1].mlp.experts.gate_up_proj[2, :32],
    "model.layers.1.mlp.experts.2.up_proj.weight": lambda m: m.model.layers[1].mlp.experts.gate_up_proj[2, 32:],
    "model.layers.1.mlp.experts.2.down_proj.weight": lambda m: m.model.layers[1].mlp.experts.down_proj[2],
}


@pytest.fixture
def fp8_ckpt(tmp_path):
    """The tiny model with a 300-wide dense MLP (partial blocks) and QUANTIZED stored as fp8 + scales. One
    scale sits in a shard of its own, away from its weight."""
    path = make_tiny(tmp_path, seed=2, intermediate_size=300)
    gen = torch.Generator().manual_seed(1)
    expected = {}
    for key in QUANTIZED:

        def edit(t, key=key):
            q, scale = quantize(t[key], gen)
            t[key] = q
            t[key + "_scale_inv"] = scale
            expected[key] = dequant_expected(q, scale)

        ckpt_edit.edit_shard(path, key, edit)
    far = "model.layers.0.mlp.down_proj.weight_scale_inv"
    scale = ckpt_edit.load_all(path)[far]
    ckpt_edit.edit_shard(path, far, lambda t: t.pop(far))
    ckpt_edit.add_shard(path, {far: scale}, "model-scales.safetensors")
    return path, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_checkpoint_loads_dequantized(fp8_ckpt, dtype):
    path, expected = fp8_ckpt
    model = load_model(path, dtype)
    for key, where in QUANTIZED.items():
        torch.testing.assert_close(where(model), expected[key].to(dtype), rtol=0, atol=0, msg=key)


def test_fp8_weight_without_scale_is_an_error(fp8_ckpt):
    path, _ = fp8_ckpt
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    ckpt_edit.edit_shard(path, key, lambda t: t.pop(key + "_scale_inv"))
    with pytest.raises(CheckpointError, match=f"{key!r} is fp8 but .* no weight_scale_inv"):
        load_model(path)
