"""Edit a safetensors checkpoint folder in tests: add a shard, rewrite tensors, keep the index in step."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"


def read_config(path) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def write_config(path, cfg: dict) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def weight_map(path) -> dict[str, str]:
    with open(os.path.join(path, INDEX)) as f:
        return json.load(f)["weight_map"]


def write_weight_map(path, wm: dict[str, str]) -> None:
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f, indent=1)


def shard_of(path, key: str) -> str:
    """The file (full path) that holds tensor `key`."""
    return os.path.join(path, weight_map(path)[key])


def load_all(path) -> dict[str, torch.Tensor]:
    out = {}
    for fname in sorted(set(weight_map(path).values())):
        out.update(load_file(os.path.join(path, fname)))
    return out


def add_shard(path, tensors: dict[str, torch.Tensor], fname: str = "model-extra.safetensors") -> str:
    save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
    write_weight_map(path, {**weight_map(path), **{k: fname for k in tensors}})
    return os.path.join(path, fname)


def edit_shard(path, key: str, edit) -> str:
    """Apply `edit(tensors)` (mutate the dict: set, replace or delete entries) to the shard holding `key`;
    rewrite that shard and the index. Returns the shard's path."""
    wm = weight_map(path)
    fname = wm[key]
    tensors = load_file(os.path.join(path, fname))
    edit(tensors)
    save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
    write_weight_map(path, {**{k: f for k, f in wm.items() if f != fname}, **{k: fname for k in tensors}})
    return os.path.join(path, fname)


def assert_names_its_file(msg: str) -> None:
    """A load error about one tensor starts with the file that holds it: '<file>: [unexpected] tensor '<key>' ...'."""
    m = re.match(r"(.+?): (?:unexpected |cannot read )?tensor '([^']+)'", msg)
    if m is None or "truncated" in msg:  # not about one tensor, or a file that cannot be opened
        return
    with safe_open(m[1], framework="pt") as h:
        assert m[2] in h.keys(), msg


def fuse_experts(src: str, dst: str) -> None:
    """Rewrite a per-expert checkpoint in transformers 5's fused form (experts.gate_up_proj / down_proj)."""
    os.makedirs(dst)
    out = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(src, f)))
    for layer in {k.split(".")[2] for k in out if ".experts." in k}:
        p = f"model.layers.{layer}.mlp.experts."
        n = len({k for k in out if k.startswith(p)}) // 3
        gate_up = [[out.pop(f"{p}{e}.gate_proj.weight"), out.pop(f"{p}{e}.up_proj.weight")] for e in range(n)]
        out[p + "gate_up_proj"] = torch.stack([torch.cat(pair) for pair in gate_up])
        out[p + "down_proj"] = torch.stack([out.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as a, open(os.path.join(dst, "config.json"), "w") as b:
        b.write(a.read())
