"""Quantized test checkpoints and their dequantized twins, written independently of mlaserve's dequantization:
INT4 unpacked by compressed-tensors (the library that defines the format) when it is installed, else bit by bit
here; FP8 block by block."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mlaserve.models.make_random import make_random

BLOCK = 128

# Dims that are not multiples of 128: partial FP8 blocks everywhere (kv_a_proj_with_mqa has 160 + 8 = 168 rows,
# like DeepSeek's 576); q_a_proj's 256 rows fill whole blocks, so it still shares one GEMM with kv_a (stack_rows).
FP8_ODD = {
    "hidden_size": 192,
    "intermediate_size": 300,
    "moe_intermediate_size": 160,
    "q_lora_rank": 256,
    "kv_lora_rank": 160,
}

# FP8_ODD as the Triton MLA kernels take it (kv_lora_rank a power of two): kv_a_proj_with_mqa's 256 + 8 = 264 rows
# still end inside a block, and hidden, intermediate and moe_intermediate stay off the 128 grid.
FP8_ODD_TRITON = dict(FP8_ODD, kv_lora_rank=256)

# FP8 dims whose TP2 shards fill whole blocks (q_b and o_proj 256 = 4 heads x 64, the MLPs 256) while kv_a (80 rows)
# and kv_b's shards (224 rows, expanded) still end inside a block.
FP8_TP = {
    "hidden_size": 256,
    "qk_nope_head_dim": 48,
    "qk_rope_head_dim": 16,
    "v_head_dim": 64,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "intermediate_size": 256,
    "moe_intermediate_size": 256,
}
INT4_TP = {"moe_intermediate_size": 64}  # moe-TP2: 32 per rank, one group


def make_quantized(out, scheme: str, preset: str = "tiny", seed: int = 0, **overrides) -> str:
    return make_random(
        preset, str(out), seed=seed, dtype="float32", progress=False, quantization=scheme, overrides=overrides
    )


def unpack_int4(packed: torch.Tensor, shape) -> torch.Tensor:
    """packed int32 [out, in/8] -> q int [out, in] in [-8, 7]."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    except ImportError:
        words = packed.to(torch.int64) & 0xFFFFFFFF
        q = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(packed.shape[0], -1) - 8
        return q[:, : shape[1]]
    return unpack_from_int32(packed, 4, torch.Size(shape)).long()


def dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    out = torch.empty(w.shape)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = w[rows, cols].float() * scale_inv[i, j]
    return out


def dequantized_twin(src: str, dst: str) -> str:
    """dst: src with every quantized weight replaced by its fp32 dequantization and no quantization_config."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if not f.endswith((".safetensors", ".json")):
            shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    cfg.pop("quantization_config", None)
    cfg.get("text_config", {}).pop("quantization_config", None)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(src, f), "pt") as h:
                tensors.update({k: h.get_tensor(k) for k in h.keys()})
    out = {}
    for key, t in tensors.items():
        base = key.rpartition(".")[0]
        if key.endswith(".weight_packed"):
            shape = tensors[base + ".weight_shape"].tolist()
            scale = tensors[base + ".weight_scale"].float().repeat_interleave(32, dim=1)
            out[base + ".weight"] = unpack_int4(t, shape).float() * scale
        elif key.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            out[key] = dequant_fp8(t, tensors[key + "_scale_inv"])
        elif not key.endswith((".weight_scale", ".weight_shape", ".weight_scale_inv")):
            out[key] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst
