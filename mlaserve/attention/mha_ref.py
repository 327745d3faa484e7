"""Paged GQA attention for the EAGLE3 Llama-style draft layer (torch reference; the draft is one layer).

Cache: [pages, page_size, 2, kv_heads, head_dim], indexed by the same page tables as the target's cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import ForwardBatch

QUERY_BLOCK = 2048


class PagedMHARef:
    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache = kv_cache
        self.page_size = kv_cache.shape[1]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, batch: ForwardBatch
    ) -> torch.Tensor:
        """Store k/v [T, kv_heads, d] at the batch's slots, then causal attention of q [T, heads, d] over each
        request's context (its queries are the last q_len positions). -> [T, heads, d]"""
        flat = self.kv_cache.view(-1, *self.kv_cache.shape[2:])  # [slots, 2, kv_heads, d]
        ok = batch.slot_mapping >= 0  # negative slots are padding: not stored
        flat[batch.slot_mapping[ok], 0] = k[ok].to(flat.dtype)
        flat[batch.slot_mapping[ok], 1] = v[ok].to(flat.dtype)
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        qo = 0
        for i in range(batch.num_reqs):
            n, L = batch.query_lens_cpu[i], batch.seq_lens_cpu[i]
            pages = batch.page_table[i, : -(-L // self.page_size)].long()
            kv = self.kv_cache[pages].reshape(-1, *self.kv_cache.shape[2:])[:L]  # [L, 2, kvh, d]
            qi, ki, vi = q[qo : qo + n].transpose(0, 1), kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)
            if group > 1:  # GQA: expand the kv heads (SDPA's enable_gqa falls back to the O(n L) math kernel)
                ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
            # SDPA over query blocks: flash/memory-efficient on the GPU, and even a math fallback stays bounded.
            o = torch.empty_like(qi)
            for c0 in range(0, n, QUERY_BLOCK):
                c1 = min(c0 + QUERY_BLOCK, n)
                j = torch.arange(c0, c1, device=q.device)  # query j sees keys <= L - n + j
                visible = torch.arange(L, device=q.device)[None, :] <= (L - n + j)[:, None]
                o[:, c0:c1] = F.scaled_dot_product_attention(qi[:, c0:c1], ki, vi, attn_mask=visible, scale=scale)
            out[qo : qo + n] = o.transpose(0, 1)
            qo += n
        return out
