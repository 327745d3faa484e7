"""Paged GQA attention for the EAGLE3 Llama-style draft layer: the KV store and the decode attention, CUDA-graph safe.

Cache [pages, page_size, 2, kv_heads, d]. Each request feeds q_len tokens (1 for a draft decode step, N for the
extension after a verify); token j sees positions <= seq_len - q_len + j. Split-KV (flash decoding): one program per
(request, kv head, split) holds the request's q_len tokens x the kv head's query heads as the rows of one tile, so
each K and V tile is read once for all of them, and walks its split in BLOCK_N-position tiles with an online softmax;
a combine kernel weights the splits' partial outputs. The draft reads its whole context every step, so at long
contexts a program per (token, head) walking all of it serially was the draft's largest cost.
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
    """k, v [T, kv_heads, d] (any token stride: column views of a fused q|k|v output are read in place; a token's
    heads not back to back are copied first) -> cache [pages, page_size, 2, kv_heads, d] at flat slots
    page * page_size + offset (slots < 0 skipped)."""
    T, kvh, d = k.shape
    if T == 0:
        return
    k, v = k.reshape(T, kvh * d), v.reshape(T, kvh * d)  # views where each token's heads are dense
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


# split-KV: the (request, kv head, split) programs aim at about two per SM of an H200 (132 SMs)
SPLIT_PROGRAMS = 264
MAX_SPLITS = 32
BLOCK_N = 64


def num_splits(num_reqs: int, kv_heads: int) -> int:
    """Splits of each context: enough (request, kv head, split) programs to fill the GPU. A function of the batch's
    shape only, so a CUDA graph captures it; each split's length follows the request's context on the device."""
    return max(1, min(MAX_SPLITS, triton.cdiv(SPLIT_PROGRAMS, max(1, num_reqs * kv_heads))))


@triton.jit
def _split_kernel(
    Q,
    Cache,
    PageTable,
    SeqLens,
    OPart,
    LsePart,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_ckv,
    stride_ch,
    stride_pt,
    H,
    S,
    GROUP: tl.constexpr,
    Q_LEN: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One (request, kv head, split): its Q_LEN tokens x GROUP heads as the rows of one tile (each K and V tile is
    loaded once for all of them), online softmax over the split's positions; writes each row's normalized partial
    output and its log2-sum-exp."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, S), BLOCK_N) * BLOCK_N
    lo = s * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    r = tl.arange(0, ROWS)
    j = r // GROUP  # the row's token within the request's Q_LEN
    h = kvh * GROUP + r % GROUP
    r_ok = r < Q_LEN * GROUP
    t = b * Q_LEN + j
    n_vis = seq_len - Q_LEN + j + 1  # the row sees positions < n_vis
    d = tl.arange(0, BLOCK_D)
    dok = d < D
    q = tl.load(
        Q + t.to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
        mask=r_ok[:, None] & dok[None, :],
        other=0.0,
    )  # [ROWS, BLOCK_D]
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < hi
        page = tl.load(PageTable + b * stride_pt + pos // PAGE_SIZE, mask=ok, other=0)
        row = Cache + page.to(tl.int64) * stride_cp + (pos % PAGE_SIZE) * stride_cs + kvh * stride_ch
        k = tl.load(row[:, None] + d[None, :], mask=ok[:, None] & dok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        sc = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [ROWS, BLOCK_N]
        sc = tl.where(ok[None, :] & (pos[None, :] < n_vis[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp2(sc - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(row[:, None] + stride_ckv + d[None, :], mask=ok[:, None] & dok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = (t.to(tl.int64) * H + h) * S + s  # [T, H, S] row-major
    tl.store(LsePart + part, lse, mask=r_ok)
    tl.store(OPart + part[:, None] * D + d[None, :], out, mask=r_ok[:, None] & dok[None, :])


@triton.jit
def _combine_kernel(
    OPart,
    LsePart,
    Out,
    stride_ot,
    stride_oh,
    H,
    S,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out[t, h] = the splits' partial outputs weighted by their share of the softmax's sum."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    sok = sp < S
    base = (t.to(tl.int64) * H + h) * S
    lse = tl.load(LsePart + base + sp, mask=sok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # nothing visible (a padded row): out = 0
    w = tl.exp2(lse - m)
    d = tl.arange(0, BLOCK_D)
    dok = d < D
    o = tl.load(OPart + (base + sp)[:, None] * D + d[None, :], mask=sok[:, None] & dok[None, :], other=0.0)
    den = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(Out + t.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=dok)


def gqa_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    scale: float,
    out: torch.Tensor,
    splits: int | None = None,
) -> torch.Tensor:
    """q [B*q_len, H, d] -> out [B*q_len, H, d]; cache [pages, page_size, 2, kv_heads, d]. splits: each context's
    split count (default num_splits(B, kv_heads))."""
    T, H, D = q.shape
    kvh = cache.shape[3]
    if q_len < 1 or H % kvh or T % q_len:
        raise ValueError(f"q: {H} heads over {kvh} kv heads, {T} tokens over q_len {q_len}")
    if T == 0:
        return out
    B, group = T // q_len, H // kvh
    S = splits or num_splits(B, kvh)
    o_part = torch.empty(T, H, S, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(T, H, S, dtype=torch.float32, device=q.device)
    BLOCK_D = triton.next_power_of_2(D)
    _split_kernel[(B, kvh, S)](
        q,
        cache,
        page_table,
        seq_lens,
        o_part,
        lse_part,
        scale * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        page_table.stride(0),
        H,
        S,
        GROUP=group,
        Q_LEN=q_len,
        ROWS=max(16, triton.next_power_of_2(q_len * group)),
        D=D,
        BLOCK_D=BLOCK_D,
        BLOCK_N=BLOCK_N,
        PAGE_SIZE=cache.shape[1],
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    _combine_kernel[(T, H)](
        o_part,
        lse_part,
        out,
        out.stride(0),
        out.stride(1),
        H,
        S,
        D=D,
        BLOCK_D=BLOCK_D,
        BLOCK_S=triton.next_power_of_2(S),
        num_warps=4,
    )
    return out
