"""Routed experts kept quantized in memory, as their checkpoints store them (docs/design.md section 5).

- Int4Experts (compressed-tensors pack-quantized, Kimi-K2.5): w13_packed int32 [E, 2I, D/8] (gate rows, then up
  rows), w13_scale bf16 [E, 2I, D/32], w2_packed int32 [E, D, I/8], w2_scale bf16 [E, D, I/32].
- Fp8Experts (DeepSeek-V3): w13 float8_e4m3fn [E, 2I, D], w13_scale_inv fp32 [E, 2*ceil(I/128), ceil(D/128)] (the
  gate half's block rows, then the up half's), w2 [E, D, I], w2_scale_inv fp32 [E, ceil(D/128), ceil(I/128)].
E, I: this rank's experts and intermediate shard. The torch path dequantizes each selected expert per call; the
Triton path runs kernels/int4_moe.py / kernels/fp8_moe.py, with the add + RMSNorm after the MoE fused into their sum
as the bf16 MoE's; shared-experts fusion is not offered: the shared experts' output comes in as `add`.
"""

from __future__ import annotations

import torch

from .linear import checked_copy, new_param
from .moe import ExpertsBase, fused_experts_ref
from .quant import BLOCK, GROUP, cdiv, dequant_fp8_block, dequant_fp8_w13, dequant_int4


class QuantExperts(ExpertsBase):
    """What the two storages share: the forward (kernel or per-expert reference) and the checkpoint plumbing."""

    kernel = ("", "")  # (module under kernels/, function)

    def dequant(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert e -> (w13 fp32 [2I, D], w2 fp32 [D, I])."""
        raise NotImplementedError

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The tensors the kernel takes, in its argument order."""
        raise NotImplementedError

    def kernel_args(self) -> dict:
        """Its kernel's keyword arguments beyond those every quantized kernel takes."""
        return {}

    def forward(self, x, topk_weights, topk_ids, impl: str = "torch", add=None, shared=None, norm=None, plan_tokens=0):
        """-> the routed experts' output [T, D] in x.dtype, plus `add` (the shared experts') when given. Triton
        only: norm = (weight, eps, residual), the add + RMSNorm after the MoE fused into its sum -> (normed,
        output + residual); plan_tokens: the kernel's form and tiles chosen for max(T, plan_tokens) tokens."""
        if shared is not None:
            raise ValueError(f"{type(self).__name__}: shared-experts fusion is bf16-only")
        if norm is not None and impl != "triton":
            raise ValueError(f"{type(self).__name__}: the fused norm (norm=...) needs impl='triton'")
        if impl == "triton":
            import importlib

            module, fn = self.kernel
            kernel = getattr(importlib.import_module(f"mlaserve.kernels.{module}"), fn)
            return kernel(
                x,
                *self.stored(),
                topk_weights,
                topk_ids,
                self.expert_offset,
                add=add,
                norm=norm,
                all_local=self.num_local == self.num_experts,
                kernels=self.kernels,
                plan_tokens=plan_tokens,
                **self.kernel_args(),
            )
        y = torch.zeros_like(x)
        local = topk_ids - self.expert_offset
        for e in torch.unique(local[(local >= 0) & (local < self.num_local)]).tolist():  # host sync: reference path
            w13, w2 = self.dequant(e)
            # fused_experts_ref on this one expert: the same sum, in the same expert order, as on dense weights
            y += fused_experts_ref(
                x,
                w13[None].to(x.dtype),
                w2[None].to(x.dtype),
                topk_weights,
                topk_ids,
                self.expert_offset + e,
                self.kernels.pdl,
            )
        return y if add is None else y + add

    def _half(self, which: str, n: int) -> slice:
        return slice(0, n) if which == "gate_proj" else slice(n, 2 * n)


class Int4Experts(QuantExperts):
    suffixes = ("weight_packed", "weight_scale", "weight_shape")
    kernel = ("int4_moe", "int4_fused_experts")

    def __init__(self, num_experts: int, hidden: int, inter: int, *, name: str = "experts", **shards):
        super().__init__(num_experts, hidden, inter, **shards)
        for what, n in (("hidden_size", hidden), ("moe_intermediate_size / moe_tp_size", self.i_local)):
            if n % GROUP:
                raise ValueError(
                    f"{name}: INT4 experts need {what} to be a multiple of the group size {GROUP}, got {n}"
                )
        E, D, I = self.num_local, hidden, self.i_local
        self.w13_packed = new_param(E, 2 * I, D // 8, dtype=torch.int32, hf_shape=(num_experts, 2 * inter, D // 8))
        self.w13_scale = new_param(E, 2 * I, D // GROUP, dtype=torch.bfloat16)
        self.w2_packed = new_param(E, D, I // 8, dtype=torch.int32, hf_shape=(num_experts, D, inter // 8))
        self.w2_scale = new_param(E, D, I // GROUP, dtype=torch.bfloat16)

    def expert_shape(self, which: str, suffix: str = "weight_packed") -> tuple[int, ...]:
        out_f, in_f = super().expert_shape(which)
        return {"weight_packed": (out_f, in_f // 8), "weight_scale": (out_f, in_f // GROUP), "weight_shape": (2,)}[
            suffix
        ]

    def load_expert(self, expert: int, which: str, suffix: str, src) -> None:
        """Copy this rank's slice of one checkpoint tensor: the packed words and scales as stored."""
        e = expert - self.expert_offset
        if suffix == "weight_shape":  # (out, in): checked by the loader, nothing to store
            return
        unit = 8 if suffix == "weight_packed" else GROUP  # inputs per stored column
        dst = (self.w13_packed if suffix == "weight_packed" else self.w13_scale).data[e]
        if which == "down_proj":
            dst = (self.w2_packed if suffix == "weight_packed" else self.w2_scale).data[e]
            s = self.inter_shard
            checked_copy(dst, src[:, s.start // unit : s.stop // unit])
        else:
            checked_copy(dst[self._half(which, self.i_local)], src[self.inter_shard])

    def dequant(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequant_int4(self.w13_packed[e], self.w13_scale[e], self.hidden),
            dequant_int4(self.w2_packed[e], self.w2_scale[e], self.i_local),
        )

    def stored(self):
        return self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale

    def kernel_args(self) -> dict:
        return dict(num_experts=self.num_experts)  # EP: the GEMV's tiles follow the pairs a rank owns

    def logical_numel(self) -> int:
        """Weights this rank holds, counted as unpacked values."""
        return 8 * (self.w13_packed.numel() + self.w2_packed.numel())


class Fp8Experts(QuantExperts):
    suffixes = ("weight", "weight_scale_inv")
    kernel = ("fp8_moe", "fp8_fused_experts")

    def __init__(self, num_experts: int, hidden: int, inter: int, *, name: str = "experts", **shards):
        super().__init__(num_experts, hidden, inter, **shards)
        if self.tp_size > 1 and self.i_local % BLOCK:
            raise ValueError(
                f"{name}: FP8 experts split over moe_tp_size={self.tp_size} need moe_intermediate_size / "
                f"moe_tp_size to be a multiple of the block {BLOCK}, got {inter} / {self.tp_size} = {self.i_local}"
            )
        E, D, I = self.num_local, hidden, self.i_local
        f8 = torch.float8_e4m3fn
        self.w13 = new_param(E, 2 * I, D, dtype=f8, hf_shape=(num_experts, 2 * inter, D))
        self.w13_scale_inv = new_param(E, 2 * cdiv(I, BLOCK), cdiv(D, BLOCK), dtype=torch.float32)
        self.w2 = new_param(E, D, I, dtype=f8, hf_shape=(num_experts, D, inter))
        self.w2_scale_inv = new_param(E, cdiv(D, BLOCK), cdiv(I, BLOCK), dtype=torch.float32)

    def expert_shape(self, which: str, suffix: str = "weight") -> tuple[int, ...]:
        shape = super().expert_shape(which)
        return shape if suffix == "weight" else tuple(cdiv(n, BLOCK) for n in shape)

    def load_expert(self, expert: int, which: str, suffix: str, src) -> None:
        e = expert - self.expert_offset
        unit = 1 if suffix == "weight" else BLOCK  # weights per stored entry along the intermediate dim
        s = self.inter_shard
        part = slice(s.start // unit, cdiv(s.stop, unit))  # moe-TP shards are whole blocks; one rank: all of it
        if which == "down_proj":
            dst = (self.w2 if suffix == "weight" else self.w2_scale_inv).data[e]
            checked_copy(dst, src[:, part])
        else:
            dst = (self.w13 if suffix == "weight" else self.w13_scale_inv).data[e]
            n = self.i_local if suffix == "weight" else cdiv(self.i_local, BLOCK)
            checked_copy(dst[self._half(which, n)], src[part])

    def dequant(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return dequant_fp8_w13(self.w13[e], self.w13_scale_inv[e]), dequant_fp8_block(self.w2[e], self.w2_scale_inv[e])

    def stored(self):
        return self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv

    def logical_numel(self) -> int:
        return self.w13.numel() + self.w2.numel()
