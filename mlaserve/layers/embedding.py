"""Vocab-parallel embedding and lm_head: each TP rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import tp
from ..kernel_config import KernelConfig
from .linear import checked_copy, invariant_linear, new_param


class VocabParallelEmbedding(nn.Module):
    kernels = KernelConfig()  # the model's, once built (kernel_config.use_kernels)

    def __init__(self, vocab_size: int, dim: int, *, rank: int = 0, size: int = 1, dtype=None):
        super().__init__()
        self.vocab_size, self.rank, self.size = vocab_size, rank, size
        self.per_rank = -(-vocab_size // size)  # the last shard is zero-padded
        self.start = rank * self.per_rank
        self.weight = new_param(self.per_rank, dim, dtype=dtype, hf_shape=(vocab_size, dim), loader=self._load)

    def _load(self, param, src) -> None:
        end = min(self.start + self.per_rank, self.vocab_size)
        rows = src[self.start : end]
        if rows.shape[0] < self.per_rank:
            param.data.zero_()
            checked_copy(param.data[: rows.shape[0]], rows)
        else:
            checked_copy(param, rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside.unsqueeze(-1), 0)
        return tp.all_reduce(h)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h @ W^T over this rank's vocab slice, gathered across ranks; fp32 out (F.linear's, cast)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self._local_logits(h)
        if self.size > 1:
            logits = tp.all_gather_last_dim(logits)[..., : self.vocab_size]
        return logits

    def _local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logits, fp32."""
        if h.is_cuda:
            from ..kernels.gemv import gemv, gemv_serves  # triton: imported on CUDA only

            if gemv_serves(h, self.weight, max_bytes=None, max_tokens=self.kernels.gemv_serve_tokens):
                # batch-1-2 decode: the Triton GEMV writes the fp32 logits itself (no cast kernel) and, under PDL,
                # has its first weight rows in flight before the final norm ends (cuBLAS waits for it)
                return gemv(
                    h,
                    self.weight,
                    out=torch.empty(h.shape[0], self.weight.shape[0], dtype=torch.float32, device=h.device),
                    pdl=self.kernels.pdl,
                )
        y = invariant_linear(h, self.weight, self.kernels)  # deterministic mode: the same per row at every size
        return (F.linear(h, self.weight) if y is None else y).float()


def whole_table(embed: nn.Module) -> torch.Tensor | None:
    """The [V, H] weight of an embedding that holds the whole vocabulary (the draft's own, or a target's on one
    rank), whose rows the draft's input norm can gather; None for a vocabulary split over ranks."""
    if isinstance(embed, nn.Embedding) or (isinstance(embed, VocabParallelEmbedding) and embed.size == 1):
        return embed.weight
    return None
