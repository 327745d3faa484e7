"""The EAGLE3 Llama draft's attention on the GPU: Triton KV store, then paged GQA decode (CUDA-graph safe) for
decode-shaped batches (every request feeding the same q_len), or, for batches with a prefill chunk, each request's
context gathered from its pages and the target's varlen causal prefill kernel (kernels/prefill_attention.py) over it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.gqa_decode import gqa_decode, gqa_store_kv
from ..kernels.prefill_attention import prefill_attention
from .base import ForwardBatch
from .mha_ref import PagedMHARef


class TritonPagedMHA(PagedMHARef):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, batch: ForwardBatch
    ) -> torch.Tensor:
        gqa_store_kv(self.kv_cache, batch.slot_mapping, k, v)
        if batch.num_decode_reqs == batch.num_reqs:
            return gqa_decode(
                q, self.kv_cache, batch.page_table, batch.seq_lens, batch.decode_q_len, scale, torch.empty_like(q)
            )
        return self._prefill(q, scale, batch)

    def _prefill(self, q: torch.Tensor, scale: float, batch: ForwardBatch) -> torch.Tensor:
        """q [T, heads, d] over each request's whole context, its K/V read back from the cache (just stored): the
        contexts gathered into [C, 2, kv_heads, d] (C = sum of seq_lens; a few launches, no host loop), the kv heads
        repeated to the query heads (GQA), then one varlen causal launch. -> [T, heads, d]"""
        ps, dev = self.page_size, q.device
        B, C = batch.num_reqs, sum(batch.seq_lens_cpu)
        lens = batch.seq_lens[:B]
        cu_k = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))  # [B+1]
        req = torch.repeat_interleave(torch.arange(B, device=dev), lens.long(), output_size=C)  # [C]
        pos = torch.arange(C, device=dev) - cu_k[req].long()  # each context token's position in its request
        slots = batch.page_table[req, pos // ps].long() * ps + pos % ps
        kv = self.kv_cache.view(-1, *self.kv_cache.shape[2:]).index_select(0, slots)  # [C, 2, kv_heads, d]
        k, v = kv[:, 0], kv[:, 1]
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        cu_q = batch.query_start_loc[: B + 1]
        return prefill_attention(q, k, v, cu_q, cu_k, scale, torch.empty_like(q), max(batch.query_lens_cpu))
