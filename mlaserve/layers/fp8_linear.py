"""FP8 block-scaled linear layers (DeepSeek-V3's checkpoint form, HF names), kept in FP8 in memory.

`weight` float8_e4m3fn [N, K] and `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)]: w = weight * scale_inv of its
128x128 block. Replicated or sharded over the TP ranks like `Linear`; a shard must start and end on block edges so
its scales are exactly a block range of the checkpoint's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernel_config import KernelConfig
from .activation import silu_mul
from .linear import Linear, checked_copy, new_param
from .quant import BLOCK, FP8_MAX, cdiv, dequant_fp8_block


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    impl: str = "torch",
    kernels: KernelConfig = KernelConfig(),
) -> torch.Tensor:
    """x [M, K] @ dequant(weight)^T -> [M, N] in x.dtype. impl "triton": the FP8 kernel (kernels/fp8_linear.py,
    with kernels' pdl and FP8 thresholds); "torch": the reference, on the weight dequantized per call (exact
    fp32 products, then x's dtype)."""
    if impl == "triton":
        from ..kernels.fp8_linear import fp8_block_linear  # triton: imported where it runs

        return fp8_block_linear(x, weight, scale_inv, kernels=kernels)
    return F.linear(x, dequant_fp8_block(weight, scale_inv).to(x.dtype))


def shard_slices(mod, n_rows: int, n_cols: int, unit: int) -> tuple[slice, slice]:
    """mod's (a TP linear: shard, rank, size, out_features, in_features per rank) rows and columns of a
    [n_rows, n_cols] checkpoint tensor whose entries cover `unit` weights each (1: the weight; 128: its block
    scales)."""
    rows, cols = slice(0, n_rows), slice(0, n_cols)
    if mod.shard == "col":
        n = mod.out_features // unit if unit > 1 else mod.out_features
        rows = slice(mod.rank * n, (mod.rank + 1) * n) if mod.size > 1 else rows
    elif mod.shard == "row":
        n = mod.in_features // unit if unit > 1 else mod.in_features
        cols = slice(mod.rank * n, (mod.rank + 1) * n) if mod.size > 1 else cols
    return rows, cols


def scale_param(N: int, K: int, out_features: int, in_features: int, loader) -> nn.Parameter:
    """`weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)] of this rank's [N, K], the checkpoint's [ceil(out/128),
    ceil(in/128)]."""
    hf_shape = (cdiv(out_features, BLOCK), cdiv(in_features, BLOCK))
    return new_param(cdiv(N, BLOCK), cdiv(K, BLOCK), dtype=torch.float32, hf_shape=hf_shape, loader=loader)


class Fp8Linear(nn.Module):
    """y = x @ W^T with W stored as FP8 + block scales. shard=None: replicated; "col": output split by rank; "row":
    input split by rank (the caller all-reduces the partial sums). `name` only labels errors."""

    row_params = ("weight", "weight_scale_inv")  # what stack_rows stores back to back
    row_align = BLOCK  # the rows of every stacked part but the last must fill whole blocks
    kernels = KernelConfig()  # the model's, once built (kernel_config.use_kernels)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        shard: str | None = None,
        rank: int = 0,
        size: int = 1,
        dtype=None,
        impl: str = "torch",
        name: str = "",
    ):
        super().__init__()
        assert shard in (None, "col", "row")
        self.shard, self.rank, self.size, self.impl = shard, rank, size, impl
        if shard and size > 1:
            full = out_features if shard == "col" else in_features
            what = "out_features" if shard == "col" else "in_features"
            if full % size or (full // size) % BLOCK:
                raise ValueError(
                    f"{name or 'Fp8Linear'}: {what}={full} split over TP size {size} gives shards of "
                    f"{full / size:g}, not a multiple of the FP8 block {BLOCK}: each shard's scales must be whole "
                    "blocks of the checkpoint's; choose a TP size that keeps them whole"
                )
        self.in_features = in_features // size if shard == "row" else in_features
        self.out_features = out_features // size if shard == "col" else out_features
        N, K = self.out_features, self.in_features
        self.weight = new_param(
            N, K, dtype=torch.float8_e4m3fn, hf_shape=(out_features, in_features), loader=self._load_weight
        )
        self.weight_scale_inv = scale_param(N, K, out_features, in_features, self._load_scale)

    def _load_weight(self, param, src) -> None:
        rows, cols = shard_slices(self, *src.shape, 1)
        checked_copy(param, src[rows, cols])

    def _load_scale(self, param, src) -> None:
        rows, cols = shard_slices(self, *src.shape, BLOCK)
        checked_copy(param, src[rows, cols])

    def forward_stacked(self, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """x @ W^T for a weight and scales stacked by stack_rows (linear_many) or this layer's own."""
        return fp8_linear(x, weight, scale_inv, self.impl, self.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.impl, self.kernels)

    def forward_silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up): impl "triton" quantizes the product where it is computed when this layer would
        quantize it (kernels/fp8_linear.py's fp8_silu_mul_linear; same bits)."""
        if self.impl == "triton" and gate.is_cuda:
            from ..kernels.fp8_linear import fp8_silu_mul_linear  # triton: imported where it runs

            return fp8_silu_mul_linear(gate, up, self.weight, self.weight_scale_inv, kernels=self.kernels)
        return self(silu_mul(gate, up, self.kernels.pdl))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, shard={self.shard}, fp8 block {BLOCK}"


class Fp8ExpandedLinear(Linear):
    """A linear whose checkpoint weight is FP8 but which the model holds dequantized in its dtype (kv_b_proj: the
    absorbed MLA projections are per-head views of it). It keeps the checkpoint's `weight_scale_inv` too, and with
    kernels.fp8_kv_b_a8 on the Triton path an FP8 copy of the weight, so that forward_a8 runs the checkpoint's
    W8A8 product. The copy is re-derived from the held weight and the scales (requantize): a bf16 or fp32 weight is
    e4m3 x scale rounded to within 2^-9, so dividing by the same scale lands within 2^-8 of the e4m3 value, which
    rounds back to it: the checkpoint's bits. A TP shard must hold whole 128-row blocks (serves)."""

    def __init__(self, in_features: int, out_features: int, *, impl: str = "torch", name: str = "", **kw):
        super().__init__(in_features, out_features, **kw)
        self.impl, self.name = impl, name
        self.weight.expand_fp8 = True  # the loader dequantizes the checkpoint's FP8 into it (logged)
        N, K = self.out_features, self.in_features
        self.weight_scale_inv = scale_param(N, K, out_features, in_features, self._load_scale)
        self.register_buffer("w8", None, persistent=False)  # requantize's FP8 copy [N, K] (moves with .to())

    @staticmethod
    def serves(out_features: int, shard: str | None, size: int) -> bool:
        """Whether each rank's rows of a (col-sharded) weight are whole 128-row blocks, so its scales are rows of
        the checkpoint's."""
        return shard != "col" or size == 1 or (out_features % size == 0 and (out_features // size) % BLOCK == 0)

    def _load_scale(self, param, src) -> None:
        rows, cols = shard_slices(self, *src.shape, BLOCK)
        checked_copy(param, src[rows, cols])

    def requantize(self) -> None:
        """The FP8 copy from the held weight and the scales (after loading; dummy weights: after their scales are
        set), where holds_copy(): the copy costs 1 byte a weight."""
        self.w8 = self.fp8_copy() if self.holds_copy() else None

    def holds_copy(self) -> bool:
        """Whether this layer keeps the FP8 copy: kernels.fp8_kv_b_a8 asks for it and forward_a8 can run it."""
        return self.kernels.fp8_kv_b_a8 and self.impl == "triton"

    def fp8_copy(self) -> torch.Tensor:
        """The checkpoint's e4m3 weight [N, K] from the held weight and the scales."""
        N, K = self.weight.shape
        s = self.weight_scale_inv.detach()
        full = s.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
        full = full.masked_fill(full == 0, 1.0)  # an all-zero block (scale 0) stays zeros
        return (self.weight.detach().float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def forward_a8(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T as the checkpoint's W8A8 product (x quantized per token per 128 channels, the FP8 weight), where
        there is an FP8 copy, impl "triton" runs on x's device and the FP8 linear quantizes a step of x's rows
        (kernels.fp8_linear_a8_min_tokens); else None (the caller runs the held weight)."""
        if self.w8 is None or self.impl != "triton" or not x.is_cuda:
            return None
        from ..kernels.fp8_linear import fp8_block_linear, linear_form  # triton: imported where it runs

        if not linear_form(x, self.w8, self.weight_scale_inv, None, self.kernels)[1]:
            return None
        return fp8_block_linear(x, self.w8, self.weight_scale_inv, kernels=self.kernels)
