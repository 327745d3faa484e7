"""One set of weights, several checkpoint forms, the same logits: the Kimi-K2.5 wrapper layout (with a vision
tower to skip), transformers 5's save_pretrained (rope_parameters) and fused expert tensors, an MTP layer."""

import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file

from mlaserve.config import ModelConfig
from mlaserve.models.make_random import make_random

from . import ckpt_edit
from .helpers import RefRunner, load_model, make_tiny

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [300, 17, 99], list(range(100, 130))]


def logits_of(path):
    _, logits = RefRunner(load_model(path)).prefill(PROMPTS)
    return torch.cat(logits)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("plain"), seed=5)
    return path, logits_of(path)


def weights_log(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "mlaserve.weights"]


def test_kimi_wrapper_layout_gives_the_same_logits(plain, tmp_path, caplog):
    path = make_random("tiny", str(tmp_path), seed=5, dtype="float32", progress=False, wrapper=True)
    cfg = ckpt_edit.read_config(path)
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and "text_config" in cfg
    assert all(k.startswith("language_model.") for k in ckpt_edit.weight_map(path))
    ckpt_edit.add_shard(
        path,
        {
            "vision_tower.patch_embed.proj.weight": torch.randn(16, 3, 2, 2),
            "vision_tower.encoder.blocks.0.wqkv.weight": torch.randn(48, 16),
            "mm_projector.proj.0.weight": torch.randn(64, 16),
        },
        "model-vision.safetensors",
    )
    assert ModelConfig.from_pretrained(path).weight_prefix == "language_model."

    with caplog.at_level(logging.INFO, logger="mlaserve.weights"):
        got = logits_of(path)
    assert torch.equal(got, plain[1])
    vision = [m for m in weights_log(caplog) if "vision" in m]
    assert vision == ["skipped 3 vision-tower tensors: mlaserve serves the text model only"]


@pytest.fixture(scope="module")
def saved_by_transformers(plain, tmp_path_factory):
    from .hf_ref import hf_model

    hf = hf_model(plain[0])
    out = tmp_path_factory.mktemp("hf_saved")
    hf.save_pretrained(str(out))
    return out, hf


def test_transformers_save_pretrained_form(plain, saved_by_transformers):
    """transformers 5 writes rope_parameters (no rope_scaling / rope_theta) and `dtype`."""
    path, _ = saved_by_transformers
    cfg = ckpt_edit.read_config(path)
    assert "rope_parameters" in cfg and "rope_scaling" not in cfg and "rope_theta" not in cfg
    assert ModelConfig.from_pretrained(str(path)).rope == ModelConfig.from_pretrained(plain[0]).rope
    assert torch.equal(logits_of(str(path)), plain[1])


def test_fused_expert_tensors(plain, saved_by_transformers, tmp_path):
    """transformers' in-memory layout: experts.gate_up_proj [E, 2I, D] and experts.down_proj [E, D, I]."""
    saved, hf = saved_by_transformers
    shutil.copy(saved / "config.json", tmp_path / "config.json")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    assert not any(".experts.0." in k for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert torch.equal(logits_of(str(tmp_path)), plain[1])


def test_mtp_layer_is_skipped(plain, tmp_path, caplog):
    """DeepSeek-V3 ships its MTP module as layer num_hidden_layers; it loads (and is ignored) fine."""
    path = make_tiny(tmp_path, seed=5)
    L, D = 3, 64
    tensors = {
        k.replace(f"model.layers.{L - 1}.", f"model.layers.{L}."): v
        for k, v in ckpt_edit.load_all(path).items()
        if k.startswith(f"model.layers.{L - 1}.")
    }
    tensors |= {
        f"model.layers.{L}.{k}": v
        for k, v in {
            "eh_proj.weight": torch.randn(D, 2 * D),
            "enorm.weight": torch.ones(D),
            "hnorm.weight": torch.ones(D),
            "embed_tokens.weight": torch.randn(512, D),
            "shared_head.norm.weight": torch.ones(D),
            "shared_head.head.weight": torch.randn(512, D),
        }.items()
    }
    ckpt_edit.add_shard(path, tensors, "model-mtp.safetensors")
    cfg = ckpt_edit.read_config(path)
    cfg["num_nextn_predict_layers"] = 1
    ckpt_edit.write_config(path, cfg)

    with caplog.at_level(logging.INFO, logger="mlaserve.weights"):
        got = logits_of(path)
    assert torch.equal(got, plain[1])
    mtp = [m for m in weights_log(caplog) if "MTP" in m]
    assert mtp == [f"skipped {len(tensors)} tensors of the MTP layer (layers >= {L})"]
