"""A quantized checkpoint that does not fit its config, or a layout mlaserve does not compute, is refused at load
with one line naming the file (or config field), the tensor and the value."""

import shutil

import pytest
import torch

from mlaserve.config import ConfigError
from mlaserve.models.weights import CheckpointError
from tests.model import ckpt_edit
from tests.model.helpers import load_model

EXPERT = "model.layers.1.mlp.experts.3.up_proj."
ATTN = "model.layers.0.self_attn."


@pytest.fixture
def int4(int4_ckpt, tmp_path):
    return shutil.copytree(int4_ckpt, tmp_path / "int4")


@pytest.fixture
def fp8(fp8_ckpt, tmp_path):
    return shutil.copytree(fp8_ckpt, tmp_path / "fp8")


def load_error(path, kind=CheckpointError) -> str:
    with pytest.raises(kind) as info:
        load_model(path)
    msg = str(info.value)
    assert type(info.value) is kind and "\n" not in msg, msg
    ckpt_edit.assert_names_its_file(msg)
    return msg


def replace(path, key: str, new: dict) -> str:
    """Drop `key` from its shard and put `new` there; -> the shard's path."""
    return ckpt_edit.edit_shard(path, key, lambda t: (t.pop(key), t.update(new)))


def test_both_load(int4, fp8):
    load_model(int4), load_model(fp8)


# ---- the files lack what the config promises ----------------------------------------------------------------------
@pytest.mark.parametrize("key", [EXPERT + "weight_scale", EXPERT + "weight_packed", EXPERT + "weight_shape"])
def test_int4_missing_part(int4, key):
    ckpt_edit.edit_shard(int4, key, lambda t: t.pop(key))
    assert f"missing tensor {key!r}" in load_error(int4)


@pytest.mark.parametrize("key", [ATTN + "q_a_proj.weight_scale_inv", EXPERT + "weight_scale_inv"])
def test_fp8_missing_scale(fp8, key):
    ckpt_edit.edit_shard(fp8, key, lambda t: t.pop(key))
    assert f"missing tensor {key!r}" in load_error(fp8)


def test_fp8_kv_b_without_its_scale(fp8):
    key = ATTN + "kv_b_proj.weight"
    ckpt_edit.edit_shard(fp8, key + "_scale_inv", lambda t: t.pop(key + "_scale_inv"))
    assert f"{key!r} is fp8 but the checkpoint has no weight_scale_inv" in load_error(fp8)


# ---- unquantized tensors where quantized ones are expected, and the reverse -----------------------------------------
def test_int4_config_over_a_dense_expert(int4):
    shard = replace(
        int4,
        EXPERT + "weight_packed",
        {EXPERT + "weight": torch.zeros(32, 64, dtype=torch.bfloat16)},
    )
    for k in ("weight_scale", "weight_shape"):
        ckpt_edit.edit_shard(int4, EXPERT + k, lambda t, k=k: t.pop(EXPERT + k))
    msg = load_error(int4)
    assert shard in msg and repr(EXPERT + "weight") in msg and "unquantized weight (BF16)" in msg
    assert "packed INT4" in msg and "compressed-tensors INT4" in msg


def test_fp8_config_over_a_bf16_weight(fp8):
    key = ATTN + "o_proj.weight"
    replace(fp8, key, {key: torch.zeros(192, 96, dtype=torch.bfloat16)})
    msg = load_error(fp8)
    assert repr(key) in msg and "unquantized weight (BF16)" in msg and "FP8 block-scaled" in msg


@pytest.mark.parametrize("which", ["int4", "fp8"])
def test_quantized_files_without_a_quantization_config(int4, fp8, which):
    path = {"int4": int4, "fp8": fp8}[which]
    cfg = ckpt_edit.read_config(path)
    cfg.pop("quantization_config")
    ckpt_edit.write_config(path, cfg)
    msg = load_error(path)
    assert msg.endswith(", but the model holds an unquantized weight there (config.json has no quantization_config)")
    assert ("packed INT4 weight (I32)" if which == "int4" else "FP8 block-scaled weight (F8_E4M3)") in msg


def test_int4_tensors_in_an_fp8_checkpoint(fp8):
    key = ATTN + "o_proj.weight_packed"
    ckpt_edit.add_shard(fp8, {key: torch.zeros(192, 12, dtype=torch.int32)})
    assert "packed INT4 weight (I32), but the model holds an FP8 block-scaled weight" in load_error(fp8)


# ---- wrong shapes and dtypes of the quantized parts ------------------------------------------------------------------
@pytest.mark.parametrize(
    "key,bad,want",
    [
        (EXPERT + "weight_scale", torch.zeros(32, 4, dtype=torch.bfloat16), "(32, 2)"),  # groups of 16
        (EXPERT + "weight_packed", torch.zeros(32, 4, dtype=torch.int32), "(32, 8)"),
        (EXPERT + "weight_shape", torch.tensor([32, 64, 1]), "(2,)"),
    ],
)
def test_int4_wrong_shapes(int4, key, bad, want):
    replace(int4, key, {key: bad})
    msg = load_error(int4)
    assert repr(key) in msg and f"has shape {tuple(bad.shape)}, expected {want}" in msg


@pytest.mark.parametrize(
    "key,bad,want",
    [
        (ATTN + "kv_a_proj_with_mqa.weight_scale_inv", torch.ones(1, 2), "(2, 2)"),  # 176 rows: 2 blocks
        (EXPERT + "weight_scale_inv", torch.ones(1, 1), "(2, 2)"),
        (ATTN + "q_a_proj.weight", torch.zeros(256, 128, dtype=torch.float8_e4m3fn), "(256, 192)"),
    ],
)
def test_fp8_wrong_shapes(fp8, key, bad, want):
    replace(fp8, key, {key: bad})
    msg = load_error(fp8)
    assert repr(key) in msg and f"has shape {tuple(bad.shape)}, expected {want}" in msg


@pytest.mark.parametrize(
    "key,dtype,want",
    [
        (EXPERT + "weight_scale", torch.float32, "F32, expected BF16"),
        (EXPERT + "weight_packed", torch.int64, "I64, expected I32"),
        (EXPERT + "weight_shape", torch.float32, "F32, expected I64 or I32"),
    ],
)
def test_int4_wrong_dtypes(int4, key, dtype, want):
    t = ckpt_edit.load_all(int4)[key]
    shard = replace(int4, key, {key: t.to(dtype)})
    assert load_error(int4) == f"{shard}: tensor {key!r} has dtype {want}"


def test_fp8_e5m2_and_fp16_scales_refused(fp8):
    key = ATTN + "o_proj.weight"
    t = ckpt_edit.load_all(fp8)
    replace(fp8, key, {key: t[key].float().to(torch.float8_e5m2)})
    assert "has dtype F8_E5M2, expected F8_E4M3" in load_error(fp8)
    replace(fp8, key, {key: t[key]})
    replace(fp8, key + "_scale_inv", {key + "_scale_inv": t[key + "_scale_inv"].half()})
    assert "has dtype F16, expected F32" in load_error(fp8)


def test_int4_weight_shape_disagrees(int4):
    key = EXPERT + "weight_shape"
    shard = replace(int4, key, {key: torch.tensor([32, 60])})
    assert load_error(int4) == f"{shard}: tensor {key!r} says the weight is (32, 60), expected (32, 64)"


@pytest.mark.parametrize("companion", ["weight_zero_point", "weight_g_idx", "input_scale"])
def test_refused_companions(int4, companion):
    ckpt_edit.add_shard(int4, {EXPERT + companion: torch.zeros(32, 1, dtype=torch.int32)})
    msg = load_error(int4)
    want = {"weight_zero_point": "asymmetric INT4", "weight_g_idx": "act-order", "input_scale": "static activation"}
    assert repr(EXPERT + companion) in msg and want[companion] in msg


# ---- configs whose ignore list quantizes what mlaserve keeps unquantized --------------------------------------------
@pytest.mark.parametrize(
    "ignore,msg",
    [
        (["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"], "'lm_head' would"),
        (["re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "lm_head"], "q_a_proj' is INT4"),
        (["re:.*self_attn.*", "re:.*shared.*", "re:.*mlp\\.[a-z]+_proj", "lm_head", "re:.*s\\.3\\..*"], "some of"),
    ],
    ids=["lm_head", "attention", "some-experts"],
)
def test_int4_ignore_lists_that_quantize_too_much(int4, ignore, msg):
    cfg = ckpt_edit.read_config(int4)
    cfg["quantization_config"]["ignore"] = ignore
    ckpt_edit.write_config(int4, cfg)
    assert msg in load_error(int4, ConfigError)


# ---- TP shards that would cut a block or a group -------------------------------------------------------------------
def test_shards_that_cut_blocks_or_groups(int4_ckpt, fp8_ckpt):
    from mlaserve.config import ModelConfig, ParallelConfig
    from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM

    def build(path, sizes):
        DeepseekV3ForCausalLM(ModelConfig.from_pretrained(path), ranks=ParallelConfig(*sizes).rank_info(0))

    with pytest.raises(ValueError, match=r"experts: INT4 experts need moe_intermediate_size / moe_tp_size .* 16"):
        build(int4_ckpt, (2, 2, 1))
    build(int4_ckpt, (2, 1, 2))  # EP: whole experts
    with pytest.raises(ValueError, match=r"self_attn.q_b_proj: out_features=96 split over TP size 2 .* 48"):
        build(fp8_ckpt, (2, 1, 2))
