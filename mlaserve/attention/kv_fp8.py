"""The FP8 latent KV cache (--kv-cache-dtype fp8 / fp8_e4m3), stored as vLLM stores an MLA cache: the latent row
[c_kv | rope(k_pe)] (R + P values) saturated to float8_e4m3fn after dividing by one float32 scale per layer (per
tensor; 1.0, since DeepSeek-V3-family checkpoints carry none), read back as stored * scale in the compute dtype.
These two functions are the spec the kernels are held to: the stores byte for byte; mla_decode bit for bit at the
scale 1.0 (it applies the scale to its scores and output, one multiply instead of one per element)."""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # float8_e4m3fn's largest finite value: larger values saturate, never become NaN


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for EngineConfig.kv_cache_dtype (validated: auto | fp8 | fp8_e4m3)."""
    return model_dtype if kv_cache_dtype == "auto" else FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., D] (the compute dtype) -> float8_e4m3fn: x / scale in fp32, saturated, rounded to nearest even."""
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored float8_e4m3fn [..., D] -> x * scale (in fp32), rounded once to dtype (the compute dtype)."""
    return (x.float() * scale).to(dtype)
