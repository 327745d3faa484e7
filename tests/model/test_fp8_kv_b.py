"""kv_b_proj of an FP8 checkpoint: held dequantized (the absorbed projections are views of it) with the
checkpoint's block scales beside it, and with KernelConfig.fp8_kv_b_a8 an FP8 copy for the W8A8 prefill that
gives the checkpoint's e4m3 bits back; TP shards keep the scales of their rows; dummy weights get checkpoint-like
scales; the copy's bytes are counted."""

import pytest
import torch
from safetensors import safe_open

from mlaserve.config import ModelConfig
from mlaserve.kernel_config import KernelConfig
from mlaserve.layers.fp8_linear import Fp8ExpandedLinear
from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from mlaserve.models.weight_bytes import weight_bytes
from mlaserve.models.weights import checkpoint_files, load_weights


def _load(path, dtype, on: bool):
    kernels = KernelConfig(fp8_kv_b_a8=on)
    model = DeepseekV3ForCausalLM(ModelConfig.from_pretrained(path), dtype=dtype, moe_impl="triton", kernels=kernels)
    load_weights(model, path, progress=False)
    return model


def _stored(path, key):
    for f in checkpoint_files(path):
        with safe_open(f, "pt") as h:
            if key in h.keys():
                return h.get_tensor(key)
    raise KeyError(key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_copy_is_the_checkpoints(fp8_ckpt, dtype):
    model = _load(fp8_ckpt, dtype, on=True)
    for i, layer in enumerate(model.model.layers):
        kv_b = layer.self_attn.kv_b_proj
        assert isinstance(kv_b, Fp8ExpandedLinear) and kv_b.weight.dtype == dtype
        key = f"model.layers.{i}.self_attn.kv_b_proj"
        w8, scale = _stored(fp8_ckpt, key + ".weight"), _stored(fp8_ckpt, key + ".weight_scale_inv")
        assert torch.equal(kv_b.weight_scale_inv, scale)
        assert torch.equal(kv_b.w8.view(torch.uint8), w8.view(torch.uint8)), f"layer {i}"
    wb = weight_bytes(model)
    off = weight_bytes(_load(fp8_ckpt, dtype, on=False))
    assert wb.quantized - off.quantized == sum(layer.self_attn.kv_b_proj.w8.numel() for layer in model.model.layers)


def test_no_copy_unless_asked(fp8_ckpt):
    model = _load(fp8_ckpt, torch.bfloat16, on=False)
    assert all(layer.self_attn.kv_b_proj.w8 is None for layer in model.model.layers)
    torch_path = DeepseekV3ForCausalLM(ModelConfig.from_pretrained(fp8_ckpt), dtype=torch.bfloat16)  # runs no W8A8
    load_weights(torch_path, fp8_ckpt, progress=False)
    assert KernelConfig().fp8_kv_b_a8 and all(layer.self_attn.kv_b_proj.w8 is None for layer in torch_path.model.layers)
    assert not any(k.endswith(".w8") for k in _load(fp8_ckpt, torch.bfloat16, on=True).state_dict())  # not saved


def test_tp_shards_keep_their_rows_scales():
    """Column shards of whole 128-row blocks take their rows of the scales; shards that end inside a block hold the
    plain expanded weight (no W8A8 copy)."""
    full_w = torch.randn(512, 160)
    scale = torch.rand(4, 2) + 0.1
    lin = Fp8ExpandedLinear(160, 512, shard="col", rank=1, size=2, dtype=torch.float32)
    lin.weight_scale_inv.weight_loader(lin.weight_scale_inv, scale)
    lin.weight.weight_loader(lin.weight, full_w)
    assert torch.equal(lin.weight_scale_inv, scale[2:]) and torch.equal(lin.weight, full_w[256:])
    assert Fp8ExpandedLinear.serves(512, "col", 2) and not Fp8ExpandedLinear.serves(448, "col", 2)
    assert Fp8ExpandedLinear.serves(448, None, 1)


def test_dummy_weights_get_checkpoint_like_scales(tmp_path):
    from mlaserve.models.dummy_weights import init_dummy_weights
    from mlaserve.models.make_random import make_random
    from tests.helpers.quant_ckpt import FP8_ODD

    path = make_random(
        "tiny", str(tmp_path), dtype="bfloat16", quantization="fp8-block", overrides=FP8_ODD, config_only=True
    )
    model = DeepseekV3ForCausalLM(
        ModelConfig.from_pretrained(path), dtype=torch.bfloat16, moe_impl="triton", kernels=KernelConfig()
    )
    init_dummy_weights(model)
    for layer in model.model.layers:
        kv_b = layer.self_attn.kv_b_proj
        assert (kv_b.weight_scale_inv > 0).all()
        N, K = kv_b.weight.shape
        s = kv_b.weight_scale_inv.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
        assert torch.equal((kv_b.w8.float() * s).to(torch.bfloat16), kv_b.weight)


def test_a8_reference_runs_kv_b_on_the_checkpoints_bits(fp8_ckpt):
    """The GPU tests' W8A8 reference (a8_reference(kv_b=True)) quantizes the torch path's kv_b_proj product on the
    checkpoint's FP8 weight, though that path holds no FP8 copy."""
    from mlaserve.kernels.fp8_reference import fp8_block_linear_ref
    from tests.helpers.model_backend_check import a8_reference

    held = _load(fp8_ckpt, torch.float32, on=True).model.layers[0].self_attn.kv_b_proj
    torch_path = DeepseekV3ForCausalLM(ModelConfig.from_pretrained(fp8_ckpt), dtype=torch.float32)
    load_weights(torch_path, fp8_ckpt, progress=False)
    kv_b = torch_path.model.layers[0].self_attn.kv_b_proj
    x = torch.randn(5, kv_b.in_features)
    assert kv_b.w8 is None and kv_b.forward_a8(x) is None
    with a8_reference(kv_b=True):
        got = kv_b.forward_a8(x)
    assert torch.equal(got, fp8_block_linear_ref(x, held.w8, held.weight_scale_inv, a8=True).to(x.dtype))


def test_the_plan_counts_the_copy(fp8_ckpt):
    """The load log's byte plan (a meta model: no copy made) counts the FP8 copy a loaded Triton-path model holds."""
    from mlaserve.config import ParallelConfig
    from mlaserve.models.weight_bytes import weight_plan

    cfg = ModelConfig.from_pretrained(fp8_ckpt)
    (plan,) = weight_plan(cfg, ParallelConfig(), torch.bfloat16)
    loaded = weight_bytes(_load(fp8_ckpt, torch.bfloat16, on=True))
    assert plan.quantized == loaded.quantized and plan.total == loaded.total
    off = weight_bytes(_load(fp8_ckpt, torch.bfloat16, on=False))
    assert plan.quantized > off.quantized
