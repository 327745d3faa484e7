"""The loader's parts the end-to-end loads leave loose: which slices read only a box of an FP8 weight, the dtype a
dequantized slice takes, what the load log says (skipped towers and MTP layers, the FP8 expansion's bytes at one
rank and on a TP shard), tied embeddings, transformers 5's fused experts when a part is missing, and the MTP
draft's own load."""

import logging
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mlaserve.config import ModelConfig, ParallelConfig
from mlaserve.distributed.tp import RankInfo
from mlaserve.layers.fp8_linear import Fp8ExpandedLinear
from mlaserve.layers.quant import BLOCK
from mlaserve.models.deepseek_mtp import DeepseekMTP
from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from mlaserve.models.make_random import make_random
from mlaserve.models.weights import CheckpointError, _as_box, _Tensor, checkpoint_files, load_weights
from tests.helpers.quant_ckpt import FP8_TP, make_quantized
from tests.model import ckpt_edit
from tests.model.helpers import load_model

LOGGER = "mlaserve.weights"


def load_log(caplog, model, path, **kw) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        load_weights(model, str(path), progress=False, **kw)
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def stored(path, key) -> torch.Tensor:
    for f in checkpoint_files(str(path)):
        with safe_open(f, "pt") as h:
            if key in h.keys():
                return h.get_tensor(key)
    raise KeyError(key)


@pytest.mark.parametrize(
    "idx,shape,want",
    [
        (slice(2, 5), (8, 6), ((2, 5), (0, 6))),
        ((slice(None), slice(1, 3)), (8, 6), ((0, 8), (1, 3))),
        ((slice(5, 2), slice(-2, None)), (8, 6), ((5, 5), (4, 6))),  # an empty range keeps its start
        ((slice(None), slice(None), slice(None)), (8, 6), None),  # more indices than dims
        (3, (8, 6), None),
        ((slice(None), 2), (8, 6), None),
        (slice(1, 3), (8,), None),  # 1-D
        (slice(0, 8, 2), (8, 6), None),
        ((slice(None), slice(0, 6, 3)), (8, 6), None),
    ],
)
def test_only_unit_step_slices_of_a_matrix_are_a_box(idx, shape, want):
    assert _as_box(idx, shape) == want


def test_fp8_slices_come_back_dequantized_in_the_asked_dtype(tmp_path):
    """A box reads only its rows and columns and scales them by the blocks they fall in; any other index
    dequantizes the whole weight first. Both in the asked dtype."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(200, 136, generator=g) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=g) + 0.5
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    full = w.float() * scale.repeat_interleave(BLOCK, 0)[:200].repeat_interleave(BLOCK, 1)[:, :136]
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as h:
        t = _Tensor(h, "w", fp8_scale=scale, dtype=torch.bfloat16)
        assert t.shape == (200, 136)
        for idx in [(slice(10, 150), slice(5, 130)), slice(120, 200), 3, (slice(None), 7), slice(0, 200, 3)]:
            got = t[idx]
            assert got.dtype == torch.bfloat16, idx
            assert torch.equal(got, full.to(torch.bfloat16)[idx]), idx


@pytest.fixture
def tiny(tiny_ckpt, tmp_path):
    return shutil.copytree(tiny_ckpt, tmp_path / "tiny")


def test_tied_embeddings_fill_a_missing_lm_head(tiny):
    ckpt_edit.edit_shard(tiny, "lm_head.weight", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError) as e:
        load_model(tiny)
    assert str(e.value) == f"{tiny}: missing tensor 'lm_head.weight'"
    cfg = ckpt_edit.read_config(tiny)
    ckpt_edit.write_config(tiny, {**cfg, "tie_word_embeddings": True})
    model = load_model(tiny)
    assert torch.equal(model.lm_head.weight, stored(tiny, "model.embed_tokens.weight"))
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # a copy: TP shards differ
    key = "model.embed_tokens.weight"
    ckpt_edit.edit_shard(tiny, key, lambda t: t.pop(key))
    with pytest.raises(CheckpointError) as e:
        load_model(tiny)
    assert str(e.value) == f"{tiny}: missing tensor 'lm_head.weight' (and 1 more)"


def test_a_one_layer_model_loads_its_embedding_and_head(tmp_path):
    """Tensors outside the layers (embedding, final norm, lm_head) are no layer's, not layer num_hidden_layers'."""
    from tests.model.helpers import make_tiny

    path = make_tiny(tmp_path, num_hidden_layers=1)
    model = load_model(path)
    assert torch.equal(model.model.embed_tokens.weight, stored(path, "model.embed_tokens.weight"))
    assert torch.equal(model.lm_head.weight, stored(path, "lm_head.weight"))


def test_a_stray_fp8_scale_in_an_unquantized_checkpoint(tiny):
    """A weight_scale_inv is skipped only beside a weight the model expands from FP8 (kv_b_proj); elsewhere it is
    refused as the FP8 part it is."""
    key = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    shard = ckpt_edit.add_shard(tiny, {key: torch.ones(1, 1)})
    with pytest.raises(CheckpointError) as e:
        load_model(tiny)
    assert str(e.value) == (
        f"{shard}: tensor {key!r} is an FP8 block-scaled weight (F32), but the model holds an unquantized weight "
        "there (config.json has no quantization_config)"
    )


def test_a_bias_on_an_expert_is_unexpected(tiny):
    key = "model.layers.1.mlp.experts.2.gate_proj.bias"
    shard = ckpt_edit.add_shard(tiny, {key: torch.zeros(32)})
    with pytest.raises(CheckpointError) as e:
        load_model(tiny)
    assert str(e.value) == f"{shard}: unexpected tensor {key!r} (the model has no such parameter)"


def test_fused_experts_missing_a_part_name_it(tiny_ckpt, tmp_path):
    """transformers 5's fused tensors stand for every expert's projections they hold, and only those."""
    fused = str(tmp_path / "fused")
    ckpt_edit.fuse_experts(tiny_ckpt, fused)
    for part, first in (("gate_up_proj", "gate_proj"), ("down_proj", "down_proj")):
        shutil.rmtree(tmp_path / "broken", ignore_errors=True)
        broken = shutil.copytree(fused, tmp_path / "broken")
        f = os.path.join(broken, "model.safetensors")
        with safe_open(f, "pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys() if k != f"model.layers.1.mlp.experts.{part}"}
        save_file(tensors, f)
        with pytest.raises(CheckpointError) as e:
            load_model(broken)
        n = 16 if part == "gate_up_proj" else 8  # 8 experts' gate and up, or their down
        first_key = f"model.layers.1.mlp.experts.0.{first}.weight"
        assert str(e.value) == f"{broken}: missing tensor {first_key!r} (and {n - 1} more)"


def test_vision_towers_are_counted_in_the_log(tmp_path, caplog):
    path = make_random("tiny", str(tmp_path), seed=5, dtype="float32", progress=False, wrapper=True)
    ckpt_edit.add_shard(path, {"vision_tower.a.weight": torch.ones(2), "mm_projector.b.weight": torch.ones(2)})
    model = DeepseekV3ForCausalLM(ModelConfig.from_pretrained(path))
    assert load_log(caplog, model, path) == ["skipped 2 vision-tower tensors: mlaserve serves the text model only"]


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """The tiny preset (3 layers) with its MTP layer 3 and a second MTP layer 4 (layer 3's tensors renamed)."""
    path = make_random("tiny", str(tmp_path_factory.mktemp("mtp")), seed=0, dtype="float32", progress=False, mtp=True)
    layer3 = {k: v for k, v in ckpt_edit.load_all(path).items() if k.startswith("model.layers.3.")}
    ckpt_edit.add_shard(path, {k.replace(".3.", ".4.", 1): v for k, v in layer3.items()}, "model-mtp2.safetensors")
    return path, len(layer3)


def test_mtp_layers_skipped_by_the_target_and_read_by_the_draft(mtp_ckpt, caplog):
    path, n3 = mtp_ckpt
    cfg = ModelConfig.from_pretrained(path)
    target = DeepseekV3ForCausalLM(cfg)
    assert load_log(caplog, target, path) == [f"skipped {2 * n3} tensors of the MTP layer (layers >= 3)"]
    draft = DeepseekMTP(cfg, torch.float32, "torch", RankInfo())
    assert load_log(caplog, draft, path, mtp=True) == [
        "MTP layer 3 loaded; its copies of the target's embedding and lm_head (2 tensors) not read: the target's "
        f"are used; {n3} tensors of further MTP layers skipped"
    ]
    names = [n for n, _ in draft.named_parameters() if ".experts." not in n]  # layer 3's, by their HF names
    assert "model.layers.3.eh_proj.weight" in names and "model.layers.3.self_attn.o_proj.weight" in names
    for name, p in draft.named_parameters():
        if name in names:
            assert torch.equal(p, stored(path, name)), name


def test_a_checkpoint_of_one_mtp_layer_logs_no_further_ones(tmp_path, caplog):
    path = make_random("tiny", str(tmp_path), seed=0, dtype="float32", progress=False, mtp=True)
    draft = DeepseekMTP(ModelConfig.from_pretrained(path), torch.float32, "torch", RankInfo())
    assert load_log(caplog, draft, path, mtp=True) == [
        "MTP layer 3 loaded; its copies of the target's embedding and lm_head (2 tensors) not read: the target's "
        "are used"
    ]


def _expansion(path, model) -> str:
    """The load log's line for kv_b_proj's FP8 -> model dtype expansion, from the checkpoint's own tensors."""
    held = stored_b = 0
    layers = model.model.layers
    for i, layer in enumerate(layers):
        w = layer.self_attn.kv_b_proj.weight
        key = f"model.layers.{i}.self_attn.kv_b_proj.weight"
        full, scale = stored(path, key), stored(path, key + "_scale_inv")
        held += w.numel() * w.element_size()
        stored_b += w.numel() + scale.numel() * 4 * w.shape[0] // full.shape[0]
    dtype = str(layers[0].self_attn.kv_b_proj.weight.dtype).removeprefix("torch.")
    return (
        f"expanded {len(layers)} FP8 tensors (kv_b_proj) to {dtype} at load, for the absorbed MLA projections: "
        f"{held / 1e6:.1f} MB held for {stored_b / 1e6:.1f} MB in the checkpoint "
        f"(+{(held - stored_b) / 1e6:.1f} MB on this rank)"
    )


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_expansion_is_logged_with_this_ranks_bytes(tmp_path_factory, caplog, world):
    """kv_b_proj (the absorbed projections' source) is the one FP8 weight held in the model dtype: the log gives
    what it costs on this rank. At TP2 each rank's 224 rows end inside a block (FP8_TP), so the weight is the
    plain expanded form and its scales are read with it, not as a parameter of their own."""
    path = make_quantized(tmp_path_factory.mktemp("fp8tp"), "fp8-block", **FP8_TP)
    cfg = ModelConfig.from_pretrained(path)
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.bfloat16, ranks=ParallelConfig(world, world, 1).rank_info(0))
    lin = model.model.layers[0].self_attn.kv_b_proj
    assert isinstance(lin, Fp8ExpandedLinear) == (world == 1)  # TP2: no scales of its own
    kv_b = lin.weight
    assert kv_b.shape[0] == 2 * 224 // world and kv_b.dtype == torch.bfloat16
    assert load_log(caplog, model, path) == [_expansion(path, model)]
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    full = stored(path, key).float()
    scale = stored(path, key + "_scale_inv").repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    want = (full * scale[: full.shape[0], : full.shape[1]]).to(torch.bfloat16)[: kv_b.shape[0]]
    assert torch.equal(kv_b, want)
