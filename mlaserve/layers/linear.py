"""Linear layers in HF weight layout ([out, in]), replicated or sharded over the TP ranks.

Each parameter carries a `weight_loader(param, src)` that reads only this rank's shard from `src`
(a safetensors slice or a tensor: anything with `.shape` and `[...]`), so loading needs no conversion step.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..kernel_config import KernelConfig

log = logging.getLogger("mlaserve.linear")


def shard_of(src, dim: int, rank: int, size: int):
    """Rows/cols [rank*n/size, (rank+1)*n/size) of `src` along `dim`, read lazily."""
    if size == 1:
        return src[:]
    n = src.shape[dim] // size
    idx = [slice(None)] * len(src.shape)
    idx[dim] = slice(rank * n, (rank + 1) * n)
    return src[tuple(idx)]


def checked_copy(param: torch.Tensor, t: torch.Tensor) -> None:
    if tuple(t.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(t.shape)} does not match the parameter's {tuple(param.shape)}")
    param.data.copy_(t)


def new_param(*shape: int, dtype=None, hf_shape=None, loader=None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.hf_shape = tuple(hf_shape or shape)  # the full, unsharded shape in the checkpoint
    p.weight_loader = loader or (lambda param, src: checked_copy(param, src[:]))
    return p


class Linear(nn.Module):
    """y = x @ W^T. shard=None: replicated; "col": output split by rank; "row": input split by rank
    (the caller all-reduces the partial sums)."""

    row_params = ("weight",)  # what stack_rows stores back to back
    row_align = 1
    kernels = KernelConfig()  # the model's, once built (kernel_config.use_kernels)

    def __init__(
        self, in_features: int, out_features: int, *, shard: str | None = None, rank: int = 0, size: int = 1, dtype=None
    ):
        super().__init__()
        assert shard in (None, "col", "row")
        self.shard, self.rank, self.size = shard, rank, size
        if shard and (out_features if shard == "col" else in_features) % size:
            raise ValueError(f"{'out' if shard == 'col' else 'in'} features not divisible by TP size {size}")
        self.in_features = in_features // size if shard == "row" else in_features
        self.out_features = out_features // size if shard == "col" else out_features
        self.weight = new_param(
            self.out_features, self.in_features, dtype=dtype, hf_shape=(out_features, in_features), loader=self._load
        )

    def _load(self, param, src) -> None:
        if self.shard is None:
            checked_copy(param, src[:])
        else:
            checked_copy(param, shard_of(src, 0 if self.shard == "col" else 1, self.rank, self.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.kernels)

    def forward_stacked(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T for a weight stacked by stack_rows (linear_many)."""
        return linear(x, weight, self.kernels)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, shard={self.shard}"


def linear(x: torch.Tensor, w: torch.Tensor, kernels: KernelConfig = KernelConfig()) -> torch.Tensor:
    """x @ w^T. One or two rows times a small weight (decode's q|kv_a and o_proj at batch 1-2, EAGLE3's verify of
    width 2 at batch 1) go to the Triton GEMV on the GPU, which streams the weight faster than cuBLAS's GEMM there
    (kernels/gemv.py; the sizes: kernels.gemv_serve_tokens, gemv_max_bytes); all else to F.linear."""
    y = invariant_linear(x, w, kernels)
    if y is not None:
        return y
    if x.is_cuda:  # triton is imported only where it runs
        from ..kernels.gemv import gemv, gemv_serves

        if gemv_serves(x, w, kernels.gemv_max_bytes, kernels.gemv_serve_tokens):
            return gemv(x, w, pdl=kernels.pdl)
    return F.linear(x, w)


def invariant_linear(
    x: torch.Tensor, w: torch.Tensor, kernels: KernelConfig, out_dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """Deterministic mode on the GPU: x [..., K] @ w [N, K]^T by kernels/bi_gemm, each row the same bit for bit at
    every step size (cuBLAS's is not); None otherwise (the caller's usual path)."""
    if not (kernels.deterministic and x.is_cuda and w.dim() == 2):
        return None
    from ..kernels.bi_gemm import bi_gemm, bi_gemm_serves  # triton: imported on CUDA only

    x2 = x.reshape(-1, x.shape[-1])
    if not bi_gemm_serves(x2, w):  # e.g. a weight kept in another dtype than its input: cuBLAS (NOT_YET_INVARIANT)
        _warn_fallback(x2, w)
        return None
    return bi_gemm(x2, w, out_dtype=out_dtype, pdl=kernels.pdl).view(*x.shape[:-1], w.shape[0])


_FALLBACKS: set[tuple] = set()


def _warn_fallback(x: torch.Tensor, w: torch.Tensor) -> None:
    key = (x.dtype, w.dtype, tuple(w.shape))
    if key not in _FALLBACKS:
        _FALLBACKS.add(key)
        log.warning(
            "deterministic inference: a %s x %s linear %s runs on cuBLAS, whose rows are not batch-invariant",
            x.dtype,
            w.dtype,
            tuple(w.shape),
        )


def stack_rows(*linears) -> None:
    """Store the weights of linear layers that read the same input back to back in one [sum(out), in] tensor (FP8
    layers: their block scales too). Each keeps its own Parameters (HF names, loaders, shards) as row views of it,
    so `linear_many` can serve all of them with one GEMM: one launch instead of several small ones in decode.
    Layers of different kinds, or FP8 parts (but the last) whose rows end inside a block, stay apart."""
    first = linears[0]
    if any(type(lin) is not type(first) for lin in linears):
        return
    if any(lin.weight.shape[0] % first.row_align for lin in linears[:-1]):
        return  # a part's scale rows would cover rows of the next part
    for name in first.row_params:
        params = [getattr(lin, name) for lin in linears]
        w = torch.cat([p.data for p in params])
        row = 0
        for p in params:
            n = p.shape[0]
            p.data = w[row : row + n]
            row += n


def _stacked(params) -> torch.Tensor | None:
    """The one tensor `params` are row views of, back to back (stack_rows), or None."""
    w0 = params[0]
    rows, ptr, ok = 0, w0.data_ptr(), w0.is_contiguous()
    storage = w0.untyped_storage().data_ptr()  # adjacent addresses are not enough: the CUDA caching allocator
    for w in params:  # packs separate tensors back to back
        ok = (
            ok
            and w.is_contiguous()
            and w.shape[1] == w0.shape[1]
            and w.dtype == w0.dtype
            and (w.data_ptr() == ptr + rows * w0.shape[1] * w0.element_size())
            and (w.untyped_storage().data_ptr() == storage)
        )
        rows += w.shape[0]
    return w0.as_strided((rows, w0.shape[1]), (w0.shape[1], 1)) if ok else None


def linear_many(x: torch.Tensor, *linears) -> list[torch.Tensor]:
    """[lin(x) for lin in linears], by one GEMM when their weights are still stacked by `stack_rows` (the outputs
    are then column views of one [T, sum(out)] tensor). Anything that re-points a weight (`p.data = ...`,
    `model.to(other device)`) breaks the stack; each layer then runs on its own, with the same result."""
    first = linears[0]
    stacked = None
    if all(type(lin) is type(first) for lin in linears):
        stacked = [_stacked([getattr(lin, n) for lin in linears]) for n in first.row_params]
    if stacked is None or any(s is None for s in stacked):
        return [lin(x) for lin in linears]
    y = first.forward_stacked(x, *stacked)  # [T, sum(out)]
    outs, col = [], 0
    for lin in linears:
        outs.append(y[..., col : col + lin.weight.shape[0]])
        col += lin.weight.shape[0]
    return outs
