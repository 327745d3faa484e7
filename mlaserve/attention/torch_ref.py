"""The torch reference attention backend: the executable spec, on any device, one request at a time."""

from __future__ import annotations

import torch

from ..layers.rotary import apply_rope
from .base import AttentionBackend, ForwardBatch
from .kv_fp8 import dequantize_kv, quantize_kv


class TorchRefBackend(AttentionBackend):
    def _latent(self, layer_id: int, batch: ForwardBatch, i: int) -> torch.Tensor:
        """Request i's whole context [L, R+P], gathered from its pages (an FP8 cache's dequantized, in self.dtype)."""
        L = batch.seq_lens_cpu[i]
        if L == 0:  # an empty padding request (CUDA-graph buckets)
            return self.kv_cache.new_empty(0, self.kv_cache.shape[-1], dtype=self.dtype)
        n_pages = -(-L // self.page_size)
        pages = batch.page_table[i, :n_pages].long()
        kv = self.kv_cache[layer_id, pages].reshape(n_pages * self.page_size, -1)[:L]
        return dequantize_kv(kv, self.kv_scale[layer_id], self.dtype) if self.fp8 else kv

    def store_kv(self, layer_id, c_kv, k_pe, cos, sin, batch, norm=None):
        R = self.kv_lora_rank
        if norm is not None:
            c_kv = norm(c_kv)
        cache = self.kv_cache[layer_id].view(-1, self.kv_cache.shape[-1])  # [slots, R+P]
        ok = batch.slot_mapping >= 0  # negative slots are padding: not stored
        slots = batch.slot_mapping[ok]
        if self.fp8:  # the row as the compute dtype holds it (RoPE rounded to it), then quantized
            s = self.kv_scale[layer_id]
            cache[slots, :R] = quantize_kv(c_kv[ok].to(self.dtype), s)
            cache[slots, R:] = quantize_kv(apply_rope(k_pe, cos, sin, torch.empty_like(k_pe, dtype=self.dtype))[ok], s)
            return
        cache[slots, :R] = c_kv[ok].to(cache.dtype)
        cache[slots, R:] = apply_rope(k_pe, cos, sin, torch.empty_like(k_pe, dtype=cache.dtype))[ok]

    def decode(self, layer_id, q, scale, batch, out):
        R, qn = self.kv_lora_rank, batch.decode_q_len
        for i in range(batch.num_decode_reqs):
            kv = self._latent(layer_id, batch, i).float()  # [L, R+P]
            L = kv.shape[0]
            qi = q[i * qn : (i + 1) * qn].float()  # [qn, H, R+P]
            scores = torch.einsum("qhd,ld->qhl", qi, kv) * scale
            visible = torch.arange(L, device=q.device)[None, :] <= (L - qn + torch.arange(qn, device=q.device))[:, None]
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            out[i * qn : (i + 1) * qn] = torch.einsum("qhl,lr->qhr", scores.softmax(-1), kv[:, :R]).to(out.dtype)
        return out

    def prefill_context(self, layer_id, batch):
        reqs = range(batch.num_decode_reqs, batch.num_reqs)
        return torch.cat([self._latent(layer_id, batch, i) for i in reqs])

    def prefill(self, q, k_nope, k_rope, v, scale, batch, out):
        qo = ko = 0
        for i in range(batch.num_decode_reqs, batch.num_reqs):
            n, L = batch.query_lens_cpu[i], batch.seq_lens_cpu[i]
            kr = k_rope[ko : ko + L, None].expand(L, k_nope.shape[1], k_rope.shape[-1])  # one k_rope for all heads
            ki = torch.cat([k_nope[ko : ko + L], kr], -1).float()  # [L, H, N+P]
            qi, vi = q[qo : qo + n].float(), v[ko : ko + L].float()
            scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale  # [H, n, L]
            visible = torch.arange(L, device=q.device)[None, :] <= (L - n + torch.arange(n, device=q.device))[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            out[qo : qo + n] = torch.einsum("hqk,khv->qhv", scores.softmax(-1), vi).to(out.dtype)
            qo, ko = qo + n, ko + L
        return out
