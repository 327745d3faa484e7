"""RoPE of Llama-style EAGLE3 drafts (rotate-half layout): default, linear, llama3 and yarn scaling of the inverse
frequencies, with transformers' `attention_factor` on cos/sin."""

from __future__ import annotations

import math

import torch

from ..config import RopeConfig
from .rotary import yarn_inv_freq

LLAMA_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def llama_rope(scaling: dict | None, theta: float, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """A config's `rope_scaling` (or `rope_parameters`) -> (inv_freq [dim/2] fp32, attention_factor), as transformers'
    ROPE_INIT_FUNCTIONS compute them; ValueError naming the type or the missing field."""
    s = dict(scaling or {})
    kind = s.get("rope_type", s.get("type")) or "default"
    base = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if kind not in LLAMA_ROPE_TYPES:
        raise ValueError(f"rope_scaling: type {kind!r} is not supported; use one of {', '.join(LLAMA_ROPE_TYPES)}")
    if kind == "default":
        return base, 1.0
    if s.get("factor") is None and kind != "yarn":
        raise ValueError(f"rope_scaling: {kind} needs 'factor'")
    if kind == "linear":
        return base / float(s["factor"]), 1.0
    orig = int(s.get("original_max_position_embeddings") or max_pos)
    if kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s.get("low_freq_factor", 1)), float(s.get("high_freq_factor", 4))
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > orig / lo, base / factor, base)
        smooth = (orig / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    rope = RopeConfig(
        theta=theta,
        type="yarn",
        factor=float(s["factor"]) if s.get("factor") is not None else max_pos / orig,
        original_max_position_embeddings=orig,
        beta_fast=float(s.get("beta_fast") or 32),
        beta_slow=float(s.get("beta_slow") or 1),
        mscale=None if s.get("mscale") is None else float(s["mscale"]),
        mscale_all_dim=float(s.get("mscale_all_dim") or 0.0),
        truncate=bool(s.get("truncate", True)),
    )
    factor = s.get("attention_factor")
    return yarn_inv_freq(rope, dim), float(factor) if factor is not None else rope.attention_factor


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, d] in Llama's rotate-half layout by cos/sin [T, d/2] fp32; in x's dtype."""
    d = x.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_neox_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """apply_rope_neox in place: one launch on the GPU (kernels/rope_kv.rope_neox; x [T, heads, d] may be a strided
    view, unit last stride), the torch ops elsewhere (ten launches a call there)."""
    if x.is_cuda:
        from ..kernels.rope_kv import rope_neox

        return rope_neox(x, cos, sin, x, pdl)
    x.copy_(apply_rope_neox(x, cos, sin))
    return x


def llama_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, d/2] fp32 of positions [T]: cos(pos * inv_freq) * scale and sin(...) * scale; one launch on the
    GPU (kernels/rope_kv.rope_cos_sin, the same values), six torch ops elsewhere."""
    if positions.is_cuda:
        from ..kernels.rope_kv import rope_cos_sin

        return rope_cos_sin(positions, inv_freq, scale, pdl)
    f = positions.float()[:, None] * inv_freq
    return f.cos() * scale, f.sin() * scale
