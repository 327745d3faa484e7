"""A draft that does not fit the target is refused at engine start with one line naming the field and both values:
hidden size, vocabulary (and its d2t / t2d map), aux layer ids."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaserve.config import EngineConfig, SpecConfig
from mlaserve.engine.engine import LLMEngine
from mlaserve.models.make_random import random_tensor
from mlaserve.models.make_random_draft import draft_tensor_specs, make_random_draft


@pytest.fixture(scope="module")
def good(tiny_ckpt, tmp_path_factory):
    return make_random_draft("tiny-eagle3", str(tmp_path_factory.mktemp("good")), target=tiny_ckpt, dtype="float32")


def edited(good, tmp_path, config=None, tensors=None, respec=False) -> str:
    """A copy of the good draft with config keys replaced and tensors edited (respec: all weights redrawn for
    the edited config's shapes)."""
    cfg = json.load(open(os.path.join(good, "config.json")))
    cfg.update(config or {})
    t = load_file(os.path.join(good, "model.safetensors"))
    if respec:
        g = torch.Generator().manual_seed(0)
        t.update({n: random_tensor(s, i, g, torch.float32, "cpu") for n, s, i in draft_tensor_specs(cfg)})
    if tensors:
        tensors(t)
    d = str(tmp_path / "bad")
    os.makedirs(d)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    save_file(t, os.path.join(d, "model.safetensors"))
    return d


def refused(tiny_ckpt, draft, *parts) -> str:
    with pytest.raises(ValueError) as e:
        LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=SpecConfig(draft_model=draft))
    msg = str(e.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, msg
    return msg


def test_good_draft_starts(tiny_ckpt, good):
    LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=SpecConfig(draft_model=good))


def test_target_hidden_size(tiny_ckpt, good, tmp_path):
    d = edited(good, tmp_path, {"target_hidden_size": 128}, respec=True)
    refused(tiny_ckpt, d, "target_hidden_size 128", "hidden_size 64")


def test_hidden_size_with_the_shared_embedding(tiny_ckpt, good, tmp_path):
    d = edited(good, tmp_path, {"hidden_size": 32, "target_hidden_size": 64, "head_dim": 8}, respec=True)
    refused(tiny_ckpt, d, "hidden_size 32", "hidden_size 64")


def test_vocab_size(tiny_ckpt, good, tmp_path):
    d = edited(good, tmp_path, {"vocab_size": 1024})
    refused(tiny_ckpt, d, "vocab_size 1024", "vocab_size 512")


def test_draft_vocab_larger_than_the_target_vocab(tiny_ckpt, good, tmp_path):
    d = edited(good, tmp_path, {"draft_vocab_size": 600})
    refused(tiny_ckpt, d, "draft_vocab_size 600", "vocab_size 512")


def test_d2t_size(tiny_ckpt, good, tmp_path):
    def cut(t):
        t["d2t"] = t["d2t"][:255]

    refused(tiny_ckpt, edited(good, tmp_path, tensors=cut), "d2t has shape (255,)", "draft_vocab_size is 256")


def test_d2t_outside_the_vocabulary(tiny_ckpt, good, tmp_path):
    def shift(t):
        t["d2t"][-1] += 1000

    refused(tiny_ckpt, edited(good, tmp_path, tensors=shift), "d2t maps draft id 255", "[0, 512)")


def test_t2d_size(tiny_ckpt, good, tmp_path):
    def cut(t):
        t["t2d"] = t["t2d"][:500]

    refused(tiny_ckpt, edited(good, tmp_path, tensors=cut), "t2d has shape (500,)", "vocab_size is 512")


def test_t2d_disagrees_with_d2t(tiny_ckpt, good, tmp_path):
    def flip(t):
        i = int((~t["t2d"]).nonzero()[0])
        t["t2d"][i] = True

    refused(tiny_ckpt, edited(good, tmp_path, tensors=flip), "t2d marks 257 target ids", "disagree")


@pytest.mark.parametrize("ids", [[0, 1, 7], [0, -1, 2]])
def test_aux_layer_ids(tiny_ckpt, good, tmp_path, ids):
    d = edited(good, tmp_path, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}})
    refused(tiny_ckpt, d, f"eagle_aux_hidden_state_layer_ids {ids}", "num_hidden_layers 3")


def test_aux_state_count_must_match_fc(tiny_ckpt, good, tmp_path):
    """Two aux ids make fc read 2 x hidden_size; a checkpoint whose fc reads three is refused naming fc.weight, and
    num_aux_hidden_states disagreeing with the ids is refused naming both."""
    d = edited(good, tmp_path, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2]}})
    refused(tiny_ckpt, d, "fc.weight", "(64, 192)", "expected (64, 128)")
    bad = {"num_aux_hidden_states": 4, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    os.rename(d, str(tmp_path / "first"))
    refused(tiny_ckpt, edited(good, tmp_path, bad), "num_aux_hidden_states=4", "has 3 ids")
