"""The INT4 experts' torch reference (any device): compressed-tensors pack-quantized words, dequantized exactly by
the format's rules in mlaserve/layers/quant.py (re-exported here; tests/unit/test_int4_pack.py holds them to a
per-element decode and to compressed-tensors' own packer).

Layout (docs/design.md section 5): packed int32 [..., out, in/8], column c's nibble at bits 4*(c % 8) of word
c // 8, stored q + 8 (q in [-8, 7]); scale bf16 [..., out, in/32]; w[r, c] = (nibble(r, c) - 8) * scale[r, c // 32].
`int4_fused_experts_ref` is the executable spec of kernels.int4_moe.int4_fused_experts.
"""

from __future__ import annotations

import torch

from mlaserve.layers.moe import fused_experts_ref
from mlaserve.layers.quant import GROUP, dequant_int4, pack_int4, quantize_int4, unpack_int4  # noqa: F401 (the format)


def random_int4_experts(E: int, D: int, I: int, device, *, generator=None, scale_range=(0.5, 1.5)):
    """Random INT4 experts of a layer: (w13_packed [E, 2I, D/8], w13_scale [E, 2I, D/32], w2_packed [E, D, I/8],
    w2_scale [E, D, I/32]): uniform words (every nibble uniform in [0, 15]) and bf16 scales sized so each output
    has about unit variance for unit inputs. With a (CPU) generator drawn on the CPU, else on `device`."""
    where = "cpu" if generator is not None else device

    def words(*shape):
        w = torch.randint(-(2**31), 2**31, shape, dtype=torch.int64, generator=generator, device=where)
        return w.to(torch.int32).to(device)

    def scales(out, k):
        lo, hi = scale_range
        s = lo + (hi - lo) * torch.rand(E, out, k // GROUP, generator=generator, device=where)
        return (s / (4.6 * k**0.5)).to(torch.bfloat16).to(device)  # |n - 8| has rms 4.6

    return words(E, 2 * I, D // 8), scales(2 * I, D), words(E, D, I // 8), scales(D, I)


def int4_fused_experts_ref(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_experts_ref on the dequantized experts (in x.dtype), plus `add`. Only the experts some pair selects
    are dequantized, so real layer sizes stay cheap."""
    D = x.shape[1]
    E, I2, _ = w13_packed.shape
    local = topk_ids.long() - expert_offset
    owned = (local >= 0) & (local < E)
    used = torch.unique(local[owned])  # host sync: fine for the reference
    w13 = dequant_int4(w13_packed[used], w13_scale[used], D).to(x.dtype)
    w2 = dequant_int4(w2_packed[used], w2_scale[used], I2 // 2).to(x.dtype)
    remap = torch.full((E,), -1, dtype=torch.long, device=x.device)
    remap[used] = torch.arange(used.numel(), device=x.device)
    ids = torch.where(owned, remap[local.clamp(0, E - 1)], -1)  # unowned: -1, outside [0, len(used))
    y = fused_experts_ref(x, w13, w2, topk_weights, ids, 0)
    return y if add is None else y + add
