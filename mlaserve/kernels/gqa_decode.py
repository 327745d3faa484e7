"""Paged GQA attention for the EAGLE3 Llama-style draft layer: the KV store and the decode attention, CUDA-graph safe.

Cache [pages, page_size, 2, kv_heads, d]. Each request feeds q_len tokens (1 for a draft decode step, N for the
extension after a verify); token j sees positions <= seq_len - q_len + j. One program per (token, head), online
softmax over BLOCK_N-token tiles: the draft is one layer, so simplicity wins over split-KV here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kernel(
    Cache,
    Slots,
    K,
    V,
    stride_cp,
    stride_cs,
    stride_ckv,
    stride_kt,
    stride_vt,
    KVH_D: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Slots + t)
    if slot < 0:  # padding token: no slot
        return
    dst = Cache + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs
    i = tl.arange(0, BLOCK)
    ok = i < KVH_D
    tl.store(dst + i, tl.load(K + t.to(tl.int64) * stride_kt + i, mask=ok).to(Cache.dtype.element_ty), mask=ok)
    tl.store(
        dst + stride_ckv + i, tl.load(V + t.to(tl.int64) * stride_vt + i, mask=ok).to(Cache.dtype.element_ty), mask=ok
    )


def gqa_store_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [T, kv_heads, d] (contiguous per token) -> cache [pages, page_size, 2, kv_heads, d] at flat slots
    page * page_size + offset (slots < 0 skipped)."""
    T, kvh, d = k.shape
    if T == 0:
        return
    k, v = k.reshape(T, kvh * d), v.reshape(T, kvh * d)
    _store_kernel[(T,)](
        cache,
        slots,
        k,
        v,
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        k.stride(0),
        v.stride(0),
        KVH_D=kvh * d,
        BLOCK=triton.next_power_of_2(kvh * d),
        PAGE_SIZE=cache.shape[1],
    )


@triton.jit
def _decode_kernel(
    Q,
    Cache,
    PageTable,
    SeqLens,
    Out,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_ckv,
    stride_ch,
    stride_pt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    Q_LEN: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = t // Q_LEN
    j = t % Q_LEN
    seq_len = tl.load(SeqLens + b)
    last = seq_len - Q_LEN + j  # the last visible position
    d = tl.arange(0, BLOCK_D)
    dok = d < D
    q = tl.load(Q + t.to(tl.int64) * stride_qt + h * stride_qh + d, mask=dok, other=0.0).to(tl.float32)
    kvh = h // GROUP
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(0, last + 1, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos <= last
        page = tl.load(PageTable + b * stride_pt + pos // PAGE_SIZE, mask=ok, other=0)
        row = Cache + page.to(tl.int64) * stride_cp + (pos % PAGE_SIZE) * stride_cs + kvh * stride_ch
        k = tl.load(row[:, None] + d[None, :], mask=ok[:, None] & dok[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale_log2
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(row[:, None] + stride_ckv + d[None, :], mask=ok[:, None] & dok[None, :], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)
    tl.store(Out + t.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=dok)


def gqa_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """q [B*q_len, H, d] -> out [B*q_len, H, d]; cache [pages, page_size, 2, kv_heads, d]."""
    T, H, D = q.shape
    kvh = cache.shape[3]
    if H % kvh or T % q_len:
        raise ValueError(f"q: {H} heads over {kvh} kv heads, {T} tokens over q_len {q_len}")
    if T:
        _decode_kernel[(T, H)](
            q,
            cache,
            page_table,
            seq_lens,
            out,
            scale * 1.4426950408889634,
            q.stride(0),
            q.stride(1),
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            cache.stride(3),
            page_table.stride(0),
            out.stride(0),
            out.stride(1),
            GROUP=H // kvh,
            Q_LEN=q_len,
            D=D,
            BLOCK_D=triton.next_power_of_2(D),
            BLOCK_N=32,
            PAGE_SIZE=cache.shape[1],
            num_warps=4,
        )
    return out
