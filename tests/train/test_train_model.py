"""`mlaserve train-model` end to end on a tiny corpus (a few stdlib packages) and a tiny model, on the CPU: the
manifest pins the corpus and rebuilds it, the tokenizer and token files are well formed, a run stopped and resumed
continues bit for bit as an uninterrupted one, and the exported folder loads in mlaserve and transformers with equal
logits. The batch order is a function of the step alone."""

import json
import os
import shutil
import sysconfig

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mlaserve.cli import main
from mlaserve.train.batches import PackedBatches, eval_windows
from mlaserve.train.bpe import load_tokenizer
from mlaserve.train.corpus import read_manifest, read_texts

from ..model.helpers import RefRunner, load_model
from .helpers import TINY

STDLIB = sysconfig.get_paths()["stdlib"]
ROOTS = [os.path.join(STDLIB, d) for d in ("json", "email", "concurrent", "asyncio")]
FLAGS = [
    "--roots", *ROOTS, "--held-out-mod", "10", "--vocab-size", "600", "--seq-len", "64", "--micro-batch", "4",
    "--batch-tokens", "512", "--tokens", "5120", "--warmup-steps", "2", "--lr", "1e-2", "--model", json.dumps(TINY),
    "--device", "cpu", "--card-samples", "1", "--disable-tqdm",
]  # fmt: skip


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("full"))
    assert main(["train-model", work, *FLAGS]) == 0
    return work


def test_outputs(full):
    model = os.path.join(full, "model")
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"):
        assert os.path.isfile(os.path.join(model, name)), name
    assert os.path.getsize(os.path.join(model, "loss.png")) > 1000
    cfg = json.load(open(os.path.join(model, "config.json")))
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["topk_method"] == "noaux_tc"
    facts = json.load(open(os.path.join(model, "train_model.json")))
    m = json.load(open(os.path.join(full, "corpus", "manifest.json")))
    card = open(os.path.join(model, "README.md")).read()
    assert m["sha256"] in card and f"{facts['params']:,}" in card and "bits per byte" in card
    assert facts["step"] == facts["steps"] == 10 and facts["complete"]
    assert facts["bpb"] > 0 and facts["held_out_tokens"] > 0
    assert facts["samples"] and facts["samples"][0]["prompt"].startswith("def ")
    # the routing biases moved (DeepSeek-V3's balancing) and are stored fp32, as published checkpoints have them
    w = load_file(os.path.join(model, "model.safetensors"))
    bias = w["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0


def test_manifest_and_token_files(full):
    corpus = os.path.join(full, "corpus")
    m = json.load(open(os.path.join(corpus, "manifest.json")))
    hashes = [f[0] for f in m["files"]]
    assert len(set(hashes)) == len(hashes) == m["num_files"] and hashes == sorted(hashes)
    assert sum(f[1] for f in m["files"]) == m["bytes"]
    tok = load_tokenizer(os.path.join(full, "tokenizer"))
    assert tok.get_vocab_size() == 600 and tok.token_to_id("<|bos|>") == 0 and tok.token_to_id("<|eos|>") == 1
    held = np.fromfile(os.path.join(corpus, "held_out.bin"), dtype=np.uint16)
    assert (held == 0).sum() == (held == 1).sum() == m["held_out_files"]
    assert held[0] == 0 and held[-1] == 1
    # decoding the held-out stream gives the held-out files back, byte for byte
    text = tok.decode(held.tolist(), skip_special_tokens=True)
    assert len(text.encode()) == m["held_out_bytes"]


def test_rebuild_from_manifest(full, tmp_path):
    """--manifest with relocated --roots rebuilds the same corpus (same hash, same tokens); a changed file is
    refused with one error."""
    copies = [str(tmp_path / "roots" / os.path.basename(r)) for r in ROOTS]
    for r, c in zip(ROOTS, copies):
        shutil.copytree(r, c, ignore=shutil.ignore_patterns("__pycache__"))
    man = os.path.join(full, "corpus", "manifest.json")
    work = str(tmp_path / "again")
    rest = FLAGS[len(ROOTS) + 1 :]
    assert main(["train-model", work, "--stage", "tokens", "--manifest", man, "--roots", *copies, *rest]) == 0
    m1, m2 = (json.load(open(os.path.join(w, "corpus", "manifest.json"))) for w in (full, work))
    assert m1["sha256"] == m2["sha256"] and m2["roots"] == [os.path.realpath(c) for c in copies]
    for name in ("train.bin", "held_out.bin"):
        a, b = (open(os.path.join(w, "corpus", name), "rb").read() for w in (full, work))
        assert a == b, name
    _, root, path = m1["files"][0][1:]
    with open(os.path.join(copies[root], path), "a") as f:
        f.write("# changed\n")
    m, files = read_manifest(man, copies)
    with pytest.raises(ValueError, match="1 of .* missing or changed"):
        read_texts(m["roots"], files)


def test_resume_is_bit_exact(full, tmp_path):
    """Stopped at step 4 and run again: the same weights, routing biases and optimizer state as the run that
    never stopped."""
    work = str(tmp_path / "resumed")
    assert main(["train-model", work, *FLAGS, "--stop-at-step", "4", "--card-samples", "0"]) == 0
    assert json.load(open(os.path.join(work, "model", "train_model.json")))["step"] == 4
    assert main(["train-model", work, *FLAGS, "--card-samples", "0"]) == 0
    a = torch.load(os.path.join(full, "checkpoint", "checkpoint.pt"), weights_only=False)
    b = torch.load(os.path.join(work, "checkpoint", "checkpoint.pt"), weights_only=False)
    assert a["step"] == b["step"] == 10
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for i, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optimizer"]["state"][i][k]), (i, k)


def test_resume_refuses_other_settings(full, capsys):
    assert main(["train-model", full, *FLAGS, "--lr", "5e-3"]) == 2
    assert "other settings (lr differ)" in capsys.readouterr().err


@torch.no_grad()
def test_loads_in_mlaserve_and_transformers(full):
    from ..model.hf_ref import hf_logits, hf_model

    model = os.path.join(full, "model")
    ids = load_tokenizer(model).encode("def f(x):\n    return x + 1\n").ids
    _, (ours,) = RefRunner(load_model(model)).prefill([ids])
    ref = hf_logits(hf_model(model), ids)
    assert torch.isfinite(ours).all()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_batches_cover_each_window_once_per_epoch():
    tokens = torch.arange(10 * 8 + 1, dtype=torch.int32)  # 10 windows of 8 + 1
    data = PackedBatches(tokens, 8, 3, seed=5)
    firsts = [int(x[b, 0]) for i in range(10) for x, _ in [data(i)] for b in range(3)]  # 30 windows: 3 epochs
    for e in range(3):
        assert sorted(firsts[e * 10 : (e + 1) * 10]) == list(range(0, 80, 8))
    x, y = data(4)
    assert x.shape == y.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(data(4)[0], PackedBatches(tokens, 8, 3, seed=5)(4)[0])  # a function of the index alone


def test_eval_windows_predict_every_token_once():
    tokens = torch.arange(1, 21)
    x, y = eval_windows(tokens, 6, pad_id=0)
    assert y[y != -100].tolist() == list(range(2, 21))
    assert torch.equal(x[:, 1:][y[:, 1:] != -100], y[:, :-1][y[:, 1:] != -100])
