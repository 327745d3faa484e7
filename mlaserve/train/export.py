"""The trained model as an HF-format folder: config.json (DeepseekV3ForCausalLM), model.safetensors with HF names
(per-expert tensors; the routing bias fp32, as published checkpoints keep it), generation_config.json and the
tokenizer files. mlaserve, transformers and the EAGLE3 draft trainer load it as is."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from ..config import torch_dtype
from .model import DeepseekV3ForTraining

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def export_hf(model: DeepseekV3ForTraining, tokenizer_dir: str, out: str, dtype: str = "bfloat16") -> str:
    td = torch_dtype(dtype)
    tensors = {}
    for name, t in model.hf_state_dict().items():
        keep_fp32 = name.endswith("e_score_correction_bias")
        tensors[name] = t.to("cpu", torch.float32 if keep_fp32 else td).contiguous()
    os.makedirs(out, exist_ok=True)
    cfg = {**model.config, "torch_dtype": dtype}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": True}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=1)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(out, name))
    return out
