"""Quantized weights' reference maths (torch, any device): dequantization as the checkpoints define it, and the
quantizers make-random uses to write them.

- INT4 (compressed-tensors pack-quantized): packed [..., out, in/8] int32, column c's value in word c // 8 at bits
  4*(c % 8) .. +3, stored as q + 8 (q in [-8, 7]); scale [..., out, in/32] bf16; w = q * scale.
- FP8 (DeepSeek): w [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N/128), ceil(K/128)] fp32; w = w8 * scale_inv.
Both dequantize to fp32 exactly as those products (the CPU reference computes on them). The FP8 rules live with
the FP8 kernels' reference (kernels/fp8_reference.py), which this module re-exports.
"""

from __future__ import annotations

import torch

from ..kernels.fp8_reference import BLOCK, FP8_MAX, dequant_fp8_block

GROUP = 32  # INT4 group
__all__ = ["BLOCK", "FP8_MAX", "GROUP", "cdiv", "dequant_fp8_block", "dequant_fp8_w13", "dequant_int4"]
__all__ += ["pack_int4", "quantize_fp8_block", "quantize_int4", "unpack_int4"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- INT4 ------------------------------------------------------------------------------------------------------
def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """packed int32 [..., out, ceil(in/8)] -> q int8 [..., out, in] in [-8, 7] (the stored nibble minus 8)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., out, in/8, 8]; the arithmetic shift is masked off
    return (nibbles.flatten(-2)[..., :in_features] - 8).to(torch.int8)


def dequant_int4(packed: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:
    """packed [..., out, ceil(in/8)] int32, scale [..., out, in/32] -> fp32 [..., out, in]: q * scale."""
    return unpack_int4(packed, in_features).float() * scale.float().repeat_interleave(GROUP, dim=-1)[..., :in_features]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [..., out, in] integers in [-8, 7] (in % 8 == 0) -> packed int32 [..., out, in/8]."""
    if q.shape[-1] % 8:
        raise ValueError(f"pack_int4: in_features={q.shape[-1]} must be a multiple of 8")
    if q.numel() and (q.min() < -8 or q.max() > 7):
        raise ValueError("pack_int4: values must lie in [-8, 7]")
    u = (q.to(torch.int64) + 8).unflatten(-1, (-1, 8))  # [..., out, in/8, 8] in [0, 15]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (u << shifts).sum(-1)  # [0, 2^32): disjoint bits, so the sum is the bitwise or
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] (in % 32 == 0) -> (packed int32 [..., out, in/8], scale bf16 [..., out, in/32]): symmetric,
    scale = absmax / 7 per group of 32 inputs (rounded to bf16 first, so dequantizing reproduces what was rounded
    against), q = round(w / scale) clamped to [-8, 7]."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"quantize_int4: in_features={w.shape[-1]} must be a multiple of {GROUP}")
    g = w.float().unflatten(-1, (-1, GROUP))  # [..., out, in/32, 32]
    scale = (g.abs().amax(-1) / 7).to(torch.bfloat16)
    s = scale.float().masked_fill(scale == 0, 1.0).unsqueeze(-1)  # an all-zero group stores zeros
    q = torch.round(g / s).clamp(-8, 7).flatten(-2)
    return pack_int4(q), scale


# ---- FP8 -------------------------------------------------------------------------------------------------------
def dequant_fp8_w13(w13: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Experts' w13 [..., 2I, D] float8_e4m3fn with split-half block scales (the gate half's block rows, then the
    up half's) -> fp32 [..., 2I, D]."""
    return dequant_fp8_block(w13, scale_inv, half_rows=w13.shape[-2] // 2)


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)]): scale_inv = amax / 448 per
    128x128 block (partial blocks at the edges), w8 = e4m3(w / scale_inv)."""
    N, K = w.shape
    nb, kb = cdiv(N, BLOCK), cdiv(K, BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()
    amax = padded.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))  # [nb, kb]
    scale = amax / FP8_MAX
    s = scale.masked_fill(scale == 0, 1.0)
    full = s.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
