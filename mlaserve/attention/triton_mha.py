"""The EAGLE3 Llama draft's attention on the GPU: Triton KV store + paged GQA decode (CUDA-graph safe) for
decode-shaped batches (every request feeding the same q_len); prefill-shaped batches take the SDPA path."""

from __future__ import annotations

import torch

from ..kernels.gqa_decode import gqa_decode, gqa_store_kv
from .base import ForwardBatch
from .mha_ref import PagedMHARef


class TritonPagedMHA(PagedMHARef):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, batch: ForwardBatch
    ) -> torch.Tensor:
        if batch.num_decode_reqs != batch.num_reqs:
            return super().forward(q, k, v, scale, batch)
        gqa_store_kv(self.kv_cache, batch.slot_mapping, k, v)
        return gqa_decode(
            q, self.kv_cache, batch.page_table, batch.seq_lens, batch.decode_q_len, scale, torch.empty_like(q)
        )
