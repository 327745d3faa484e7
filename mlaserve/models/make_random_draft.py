"""Write a random EAGLE3 draft (Llama-style single layer, SpecForge layout) that matches a target checkpoint.

Shapes follow the target: hidden size, heads, MLP width and vocabulary; the draft vocabulary is a random,
sorted subset of the target's, mapped back by `d2t`. No embed_tokens is written: the draft shares the target's.
"""

from __future__ import annotations

import copy
import json
import math
import os

import torch
from safetensors.torch import save_file

from ..config import ModelConfig, torch_dtype
from .make_random import load_preset, random_tensor


def draft_config(preset: str, target: ModelConfig | None) -> dict:
    raw = copy.deepcopy(load_preset(preset))
    raw.pop("_note", None)
    if target is not None:
        L = target.num_hidden_layers
        ratio = raw["num_attention_heads"] // raw.get("num_key_value_heads", raw["num_attention_heads"])
        heads = target.num_attention_heads
        raw.update(
            hidden_size=target.hidden_size,
            target_hidden_size=target.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // ratio),
            intermediate_size=target.intermediate_size,
            vocab_size=target.vocab_size,
            draft_vocab_size=min(raw.get("draft_vocab_size") or target.vocab_size, target.vocab_size),
            torch_dtype=target.torch_dtype,
        )
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
        if len(ids) != 3 or not all(0 <= i < L for i in ids):
            ids = sorted(min(max(i, 0), L - 1) for i in (2, L // 2, L - 3))
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    return raw


def draft_tensor_specs(c: dict) -> list[tuple[str, tuple[int, ...], float | str]]:
    H, Ht = c["hidden_size"], c.get("target_hidden_size") or c["hidden_size"]
    nh, nkv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    hd, inter = c.get("head_dim") or H // nh, c["intermediate_size"]

    def lin(name, o, i, gain=1.0):
        return (name, (o, i), gain / math.sqrt(i))

    a, m = "midlayer.self_attn.", "midlayer.mlp."
    return [
        lin(
            "fc.weight", H, len((c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or (0, 0, 0)) * Ht
        ),
        ("midlayer.input_layernorm.weight", (H,), "norm"),
        ("midlayer.hidden_norm.weight", (H,), "norm"),
        lin(a + "q_proj.weight", nh * hd, 2 * H),
        lin(a + "k_proj.weight", nkv * hd, 2 * H),
        lin(a + "v_proj.weight", nkv * hd, 2 * H),
        lin(a + "o_proj.weight", H, nh * hd, 0.5),
        ("midlayer.post_attention_layernorm.weight", (H,), "norm"),
        lin(m + "gate_proj.weight", inter, H),
        lin(m + "up_proj.weight", inter, H),
        lin(m + "down_proj.weight", H, inter, 0.5),
        ("norm.weight", (H,), "norm"),
        lin("lm_head.weight", c["draft_vocab_size"], H, 4.0),
    ]


def make_random_draft(
    preset: str,
    out: str,
    *,
    target: str | None = None,
    seed: int = 0,
    dtype: str | None = None,
    device: str = "cpu",
    overrides: dict | None = None,
) -> str:
    """A random draft of `preset`'s format fitted to `target`; overrides: config.json fields set last (the tensors
    follow them)."""
    tcfg = ModelConfig.from_pretrained(target) if target else None
    c = draft_config(preset, tcfg)
    c.update(overrides or {})
    if dtype is not None:
        c["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    tdtype = torch_dtype(c.get("torch_dtype", "bfloat16"))
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {name: random_tensor(shape, init, gen, tdtype, device) for name, shape, init in draft_tensor_specs(c)}
    V, Vd = c["vocab_size"], c["draft_vocab_size"]
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:Vd].sort().values  # target ids
    tensors["d2t"] = ids - torch.arange(Vd)  # target_id = i + d2t[i]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out
