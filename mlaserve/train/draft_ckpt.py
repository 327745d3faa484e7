"""A trainable EAGLE3 draft's config, vocabulary map, initial weights and checkpoint, in the published Llama-style
layout (`LlamaForCausalLMEagle3`, as SpecForge writes it and vLLM, SGLang and models/eagle3.py load it)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from ..config import torch_dtype
from ..models.make_random import random_tensor
from ..models.make_random_draft import draft_config, draft_tensor_specs

TEMPLATE = "tiny-eagle3"  # the draft's layout: one Llama layer, GQA (2 query heads per kv head), default RoPE


def make_config(target, draft_vocab: int) -> dict:
    """The draft's config.json for a target ModelConfig: its hidden size, heads, MLP width and vocabulary."""
    c = draft_config(TEMPLATE, target)
    c.update(
        draft_vocab_size=draft_vocab,
        max_position_embeddings=target.max_position_embeddings,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_ids[0] if target.eos_token_ids else None,
    )
    ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    c["eagle_aux_hidden_state_layer_ids"] = ids  # vLLM's key; SGLang reads eagle_config's
    return c


def draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target ids (ties to the lower id), sorted; ids never seen fill any shortfall."""
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]), dtype=torch.int64)


def vocab_maps(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> d2t (target id = i + d2t[i]) and t2d (bool [vocab]: in the draft vocabulary), the published pair."""
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


def init_weights(cfg: dict, target_model, ids: torch.Tensor, seed: int, device) -> dict[str, torch.Tensor]:
    """fp32 trainable weights: random as make_random_draft's, except lm_head (the target's rows of the draft
    vocabulary) and the final norm (the target's): the draft learns the target's last hidden state."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    w = {name: random_tensor(shape, init, gen, torch.float32, "cpu") for name, shape, init in draft_tensor_specs(cfg)}
    w["lm_head.weight"] = target_model.lm_head.weight.detach()[ids.to(target_model.lm_head.weight.device)].float()
    w["norm.weight"] = target_model.model.norm.weight.detach().float()
    return {k: v.to(device).clone().requires_grad_(True) for k, v in w.items()}


def save_draft(out: str, cfg: dict, w: dict[str, torch.Tensor], ids, embed, dtype: str, extra: dict) -> str:
    """config.json, model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d and a copy of the target's
    embed_tokens, as SpecForge writes) and train_draft.json (how it was trained)."""
    cfg = {**cfg, "torch_dtype": dtype}
    td = torch_dtype(dtype)
    tensors = {k: v.detach().to("cpu", td).contiguous() for k, v in w.items()}
    tensors["d2t"], tensors["t2d"] = vocab_maps(ids.cpu(), cfg["vocab_size"])
    if embed is not None:
        tensors["embed_tokens.weight"] = embed.detach().to("cpu", td).contiguous()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "train_draft.json"), "w") as f:
        json.dump(extra, f, indent=1)
    return out
