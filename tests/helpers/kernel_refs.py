"""fp32 torch references with the kernels' own signatures, for tests and benchmarks (host loops, host syncs).

They restate attention/torch_ref.py's maths per kernel interface; MoE and RoPE use mlaserve.layers directly."""

from __future__ import annotations

import torch

from mlaserve.layers.moe import fused_experts_ref, route_noaux_tc
from mlaserve.layers.rotary import apply_rope


def _lower_right_causal(n: int, L: int, device) -> torch.Tensor:
    """[n, L] bool: query i (the last n positions of L) sees keys 0 .. L - n + i."""
    return torch.arange(L, device=device)[None, :] <= (L - n + torch.arange(n, device=device))[:, None]


def mla_decode_ref(q, kv_cache, page_table, seq_lens, q_len: int, scale: float, R: int) -> torch.Tensor:
    """q [B*q_len, H, R+P], kv_cache [pages, page_size, R+P] -> [B*q_len, H, R] fp32."""
    T, H, D = q.shape
    page_size = kv_cache.shape[1]
    out = torch.zeros(T, H, R, dtype=torch.float32, device=q.device)
    for b, L in enumerate(seq_lens.tolist()):
        n_pages = -(-L // page_size)
        kv = kv_cache[page_table[b, :n_pages].long()].reshape(-1, D)[:L].float()  # [L, R+P]
        qb = q[b * q_len : (b + 1) * q_len].float()
        s = torch.einsum("qhd,ld->qhl", qb, kv) * scale
        s = s.masked_fill(~_lower_right_causal(q_len, L, q.device)[:, None, :], float("-inf"))
        out[b * q_len : (b + 1) * q_len] = torch.einsum("qhl,lr->qhr", s.softmax(-1).nan_to_num(0.0), kv[:, :R])
    return out


def prefill_attention_ref(q, k, v, cu_q, cu_k, scale: float) -> torch.Tensor:
    """q [Tp, H, Dqk], k [C, H, Dqk], v [C, H, Dv] -> [Tp, H, Dv] fp32."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        n, L = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        qi, ki, vi = q[cq[b] : cq[b + 1]].float(), k[ck[b] : ck[b + 1]].float(), v[ck[b] : ck[b + 1]].float()
        s = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        s = s.masked_fill(~_lower_right_causal(n, L, q.device), float("-inf"))
        out[cq[b] : cq[b + 1]] = torch.einsum("hqk,khv->qhv", s.softmax(-1), vi)
    return out


def rope_store_kv_ref(kv_cache, slot_mapping, c_kv, k_pe, cos, sin) -> torch.Tensor:
    """Returns a copy of kv_cache with the rows written (slots < 0 skipped)."""
    cache = kv_cache.clone()
    flat = cache.view(-1, cache.shape[-1])
    R = c_kv.shape[-1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat[slots, :R] = c_kv[keep].to(cache.dtype)
    rot = apply_rope(k_pe[keep], cos[keep], sin[keep], torch.empty_like(k_pe[keep], dtype=torch.float32))
    flat[slots, R:] = rot.to(cache.dtype)
    return cache


def rope_q_ref(x, cos, sin) -> torch.Tensor:
    return apply_rope(x, cos, sin, torch.empty(x.shape, dtype=torch.float32, device=x.device))


__all__ = [
    "mla_decode_ref",
    "prefill_attention_ref",
    "rope_store_kv_ref",
    "rope_q_ref",
    "fused_experts_ref",
    "route_noaux_tc",
]
