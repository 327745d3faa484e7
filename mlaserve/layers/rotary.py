"""RoPE over interleaved pairs (DeepSeek's GPT-J layout) with YaRN, matching transformers' deepseek_v3."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import RopeConfig
from ..kernel_config import KernelConfig


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim/2] fp32 inverse frequencies, YaRN-blended when rope.type == 'yarn'."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rope.type != "yarn":
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


class RotaryEmbedding(nn.Module):
    """cos/sin per position, computed on the fly in fp32 (exact at any position, no cache to size)."""

    kernels = KernelConfig()  # the model's, once built (kernel_config.use_kernels)

    def __init__(self, rope: RopeConfig, dim: int):
        super().__init__()
        self.scale = rope.attention_factor
        self.register_buffer("inv_freq", yarn_inv_freq(rope, dim), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, P/2] fp32; on the GPU one kernel (kernels/rope_kv.rope_cos_sin) for the
        five launches of the torch form, bit-equal to it."""
        if positions.is_cuda and positions.dim() == 1:
            from ..kernels.rope_kv import rope_cos_sin

            return rope_cos_sin(positions, self.inv_freq, self.scale, pdl=self.kernels.pdl)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, P/2]
        return freqs.cos() * self.scale, freqs.sin() * self.scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [T, (H,) P] by cos/sin [T, P/2] into `out`
    (any strided view of the same shape, e.g. Q[..., R:]). Computes in fp32; writes with out= (no copy op)."""
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()
    odd_a, odd_b = x1 * cos, x0 * sin  # read both halves before either is written (out may alias x)
    torch.sub(x0 * cos, x1 * sin, out=out[..., 0::2])
    torch.add(odd_a, odd_b, out=out[..., 1::2])
    return out
