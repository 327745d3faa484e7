"""A bad checkpoint raises one clear CheckpointError / ConfigError that names the file and the tensor."""

import os
import re
import shutil

import pytest
import torch

from mlaserve.config import ConfigError
from mlaserve.models.weights import CheckpointError
from tests.model import ckpt_edit
from tests.model.helpers import load_model


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    """A private copy of the session's tiny checkpoint, free to break."""
    return shutil.copytree(tiny_ckpt, tmp_path / "ckpt")


def load_error(path, kind=CheckpointError) -> str:
    with pytest.raises(kind) as info:
        load_model(path)
    e = info.value
    msg = str(e)
    assert type(e) is kind
    assert "\n" not in msg, "one line"
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), "no chained traceback"
    ckpt_edit.assert_names_its_file(msg)
    return msg


def test_good_checkpoint_loads(ckpt):
    """The intact copy loads every tensor of the checkpoint into the parameter of that name, bit for bit."""
    from safetensors.torch import load_file

    model = load_model(ckpt)
    params = dict(model.named_parameters())
    saved = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(ckpt, f)))
    assert saved
    for name, t in saved.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            got = params[name]
        elif m[3] == "down":  # routed experts are stacked: down_proj [E, H, I]
            got = params[f"{m[1]}.down_proj"][int(m[2])]
        else:  # gate_up_proj [E, 2I, H]: gate rows, then up rows
            half = params[f"{m[1]}.gate_up_proj"][int(m[2])].chunk(2)
            got = half[0] if m[3] == "gate" else half[1]
        assert torch.equal(got.detach(), t.to(got.dtype)), name
    assert sum(p.numel() for p in params.values()) == sum(t.numel() for t in saved.values())  # nothing left unloaded


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.norm.weight",
        "model.layers.2.mlp.experts.5.up_proj.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor(ckpt, key):
    ckpt_edit.edit_shard(ckpt, key, lambda t: t.pop(key))
    assert load_error(ckpt) == f"{ckpt}: missing tensor {key!r}"


def test_several_missing_tensors_are_counted_in_one_error(ckpt):
    keys = ["model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.experts.0.down_proj.weight"]
    for key in keys:
        ckpt_edit.edit_shard(ckpt, key, lambda t, k=key: t.pop(k))
    assert load_error(ckpt) == f"{ckpt}: missing tensor {keys[0]!r} (and 1 more)"  # parameters, then experts


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.0.self_attn.bogus.weight",
        "model.layers.1.mlp.experts.8.up_proj.weight",
        "model.layers.0.mlp.experts.0.up_proj.weight",
        "transformer.wte.weight",
        "model.layers.0.self_attn.o_proj.bias",  # beside a weight the model has
    ],
)
def test_unexpected_tensor(ckpt, key):
    """A tensor the model has no place for: unknown name, expert past n_routed_experts, expert in a dense
    layer, a foreign prefix."""
    shard = ckpt_edit.add_shard(ckpt, {key: torch.zeros(32, 64)})
    msg = load_error(ckpt)
    assert "unexpected tensor" in msg and repr(key) in msg and shard in msg


@pytest.mark.parametrize(
    "key,shape",
    [
        ("model.layers.0.self_attn.kv_b_proj.weight", (4 * 40, 31)),
        ("model.layers.1.mlp.experts.3.down_proj.weight", (32, 64)),
        ("model.embed_tokens.weight", (511, 64)),
        ("model.layers.2.mlp.gate.e_score_correction_bias", (7,)),
    ],
)
def test_mis_shaped_tensor(ckpt, key, shape):
    shard = ckpt_edit.edit_shard(ckpt, key, lambda t: t.update({key: torch.zeros(shape)}))
    msg = load_error(ckpt)
    assert repr(key) in msg and shard in msg and str(tuple(shape)) in msg


@pytest.mark.parametrize("keep", [0.5, 0.999, 8e-5], ids=["half", "last_bytes", "header"])
def test_truncated_safetensors_file(ckpt, keep):
    shard = ckpt_edit.shard_of(ckpt, "model.norm.weight")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(max(int(size * keep), 4))
    msg = load_error(ckpt)
    assert shard in msg and "truncated" in msg


def test_unsupported_architecture(ckpt):
    cfg = ckpt_edit.read_config(ckpt)
    cfg["architectures"] = ["LlamaForCausalLM"]
    ckpt_edit.write_config(ckpt, cfg)
    msg = load_error(ckpt, ConfigError)
    assert os.path.join(ckpt, "config.json") in msg and "'LlamaForCausalLM'" in msg


def test_missing_config_json(ckpt):
    os.remove(os.path.join(ckpt, "config.json"))
    msg = load_error(ckpt, ConfigError)
    assert os.path.join(ckpt, "config.json") in msg and "not found" in msg


def test_config_missing_a_required_field(ckpt):
    cfg = ckpt_edit.read_config(ckpt)
    del cfg["kv_lora_rank"]
    ckpt_edit.write_config(ckpt, cfg)
    msg = load_error(ckpt, ConfigError)
    assert "config.json" in msg and "'kv_lora_rank'" in msg


def test_index_lists_a_missing_file(ckpt):
    wm = ckpt_edit.weight_map(ckpt)
    wm["model.norm.weight"] = "model-00009-of-00009.safetensors"
    ckpt_edit.write_weight_map(ckpt, wm)
    msg = load_error(ckpt)
    assert ckpt_edit.INDEX in msg and "model-00009-of-00009.safetensors" in msg


def test_index_is_not_json(ckpt):
    with open(os.path.join(ckpt, ckpt_edit.INDEX), "w") as f:
        f.write('{"weight_map": {')
    msg = load_error(ckpt)
    assert ckpt_edit.INDEX in msg


def test_no_safetensors_files(ckpt):
    for f in os.listdir(ckpt):
        if f.endswith((".safetensors", ".json")) and f != "config.json":
            os.remove(os.path.join(ckpt, f))
    msg = load_error(ckpt)
    assert str(ckpt) in msg and "no *.safetensors" in msg


def test_wrapper_config_over_plain_tensors(ckpt):
    """A Kimi-K2.5 config.json over a plain-layout checkpoint: the error says which prefix was expected."""
    ckpt_edit.write_config(
        ckpt, {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": ckpt_edit.read_config(ckpt)}
    )
    msg = load_error(ckpt)
    assert "unexpected tensor" in msg and "'language_model.'" in msg and ".safetensors" in msg
