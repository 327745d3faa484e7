"""Varlen causal attention for prefill in the naive (MHA) form, FlashAttention-2 style, plus an SDPA alternative.

Request b's queries q[cu_q[b]:cu_q[b+1]] are the LAST positions of its context k[cu_k[b]:cu_k[b+1]], so query i
sees keys 0 .. klen - qlen + i (bottom-right aligned causal mask; a chunked prefill over a cached prefix).
The QK head dim is two parts read from two sources: MLA's k = [k_nope | k_rope] comes as k_nope [C, H, N] (a view
of the kv_b_proj output) and k_rope [C, P], one for all heads (head stride 0), so no concatenated K is built.
A plain k [C, H, Dqk] is split the same way (Dqk = largest power of two + rest, 192 = 128 + 64). Part sizes and Dv
need not be powers of two: they are padded with masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(base, pos, stride_t, offs_d, klen, D: tl.constexpr, BLOCK_D: tl.constexpr, EDGE: tl.constexpr):
    """[BLOCK_N, BLOCK_D] rows `pos` of a [klen, D] matrix, zeros outside. Without EDGE every row is < klen."""
    ptrs = base + pos.to(tl.int64)[:, None] * stride_t + offs_d[None, :]
    if EDGE:
        x = tl.load(ptrs, mask=(pos < klen)[:, None] & (offs_d < D)[None, :], other=0.0)
    elif D == BLOCK_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
    return x


@triton.jit
def _attn_tile(
    acc,
    m_i,
    l_i,
    q1,
    q2,
    k1_ptr,
    k2_ptr,
    v_ptr,
    n0,
    klen,
    q_pos,
    scale_log2,
    stride_k1t,
    stride_k2t,
    stride_vt,
    offs_n,
    offs_d1,
    offs_d2,
    offs_dv,
    D1: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    D2: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pos = n0 + offs_n
    k1 = _load_rows(k1_ptr, pos, stride_k1t, offs_d1, klen, D1, BLOCK_D1, MASKED)  # [N, BD1]
    s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
    if D2 > 0:
        k2 = _load_rows(k2_ptr, pos, stride_k2t, offs_d2, klen, D2, BLOCK_D2, MASKED)  # [N, BD2]
        s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)  # accumulates in the MMA (no extra add)
    if MASKED:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & (pos < klen)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    else:  # every key of the tile is visible to every row: the row max is finite
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * scale_log2 - m_use[:, None])  # the scale folded into one FMA with the max
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_ptr, pos, stride_vt, offs_dv, klen, DV, BLOCK_DV, MASKED)  # [N, BDV]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def program_tile(pid, num_mb, H, head_group):
    """Program pid -> (request, query block, head) over a flat grid of (request, head group, query block, head in
    group): within a group of heads the longest (last) query blocks start first across all its heads, so the short
    blocks fill the tail; a group's K/V (head_group heads) is what the concurrently running programs share in L2.
    Shared with the Gluon kernel (prefill_attention_gluon.py)."""
    per_req = num_mb * H
    b = pid // per_req
    r = pid % per_req
    grp = r // (num_mb * head_group)
    r = r % (num_mb * head_group)
    mb = num_mb - 1 - r // head_group
    h = grp * head_group + r % head_group
    return b, mb, h


@triton.jit
def request_rows(Cu, b):
    """(first row, row count) of request b from its cumulative offsets Cu [B+1]."""
    start = tl.load(Cu + b)
    return start, tl.load(Cu + b + 1) - start


@triton.jit
def _prefill_attention_kernel(
    Q,
    K1,
    K2,
    V,
    O,
    CuQ,
    CuK,
    scale_log2,
    num_mb,
    stride_qt,
    stride_qh,
    stride_k1t,
    stride_k1h,
    stride_k2t,
    stride_k2h,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    H,
    head_group,
    D1: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    D2: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b, mb, h = program_tile(tl.program_id(0), num_mb, H, head_group)
    q0, qlen = request_rows(CuQ, b)
    if mb * BLOCK_M >= qlen:
        return
    k0, klen = request_rows(CuK, b)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < qlen
    q_pos = klen - qlen + offs_m  # each query's position in its context
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_rows = Q + (q0 + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    q1 = tl.load(q_rows + offs_d1[None, :], mask=m_ok[:, None] & (offs_d1 < D1)[None, :], other=0.0)
    q2 = tl.load(q_rows + D1 + offs_d2[None, :], mask=m_ok[:, None] & (offs_d2 < D2)[None, :], other=0.0)
    k1_ptr = K1 + k0.to(tl.int64) * stride_k1t + h * stride_k1h
    k2_ptr = K2 + k0.to(tl.int64) * stride_k2t + h * stride_k2h  # stride_k2h = 0: one k_rope for all heads
    v_ptr = V + k0.to(tl.int64) * stride_vt + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Keys up to the block's first query position are visible to every row: no mask there (nor bounds: < klen).
    # Past the last row's position nothing is visible: causal tiles are skipped.
    unmasked_end = ((klen - qlen + mb * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    hi = klen - qlen + tl.minimum((mb + 1) * BLOCK_M, qlen)
    for n0 in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            acc,
            m_i,
            l_i,
            q1,
            q2,
            k1_ptr,
            k2_ptr,
            v_ptr,
            n0,
            klen,
            q_pos,
            scale_log2,
            stride_k1t,
            stride_k2t,
            stride_vt,
            offs_n,
            offs_d1,
            offs_d2,
            offs_dv,
            D1,
            BLOCK_D1,
            D2,
            BLOCK_D2,
            DV,
            BLOCK_DV,
            False,
            DOT_PREC,
        )
    for n0 in range(unmasked_end, hi, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            acc,
            m_i,
            l_i,
            q1,
            q2,
            k1_ptr,
            k2_ptr,
            v_ptr,
            n0,
            klen,
            q_pos,
            scale_log2,
            stride_k1t,
            stride_k2t,
            stride_vt,
            offs_n,
            offs_d1,
            offs_d2,
            offs_dv,
            D1,
            BLOCK_D1,
            D2,
            BLOCK_D2,
            DV,
            BLOCK_DV,
            True,
            DOT_PREC,
        )
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptr = O + (q0 + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :]
    tl.store(o_ptr, o.to(O.dtype.element_ty), mask=m_ok[:, None] & (offs_dv < DV)[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prefill_config(Dqk: int, Dv: int, dtype: torch.dtype) -> dict:
    if dtype == torch.float32:  # tests only (IEEE fp32 dots); 8 warps keep Dqk=192 tiles out of local memory
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4 if Dqk + Dv <= 128 else 8, num_stages=1, HEAD_GROUP=4)
    # bf16, Dqk=192, Dv=128: Q 48 KB + (K 24 KB + V 16 KB) x 3 buffers = 168 KB of shared memory. Three stages:
    # with two, Triton 3.6 waits for every copy at the top of each iteration (no load/compute overlap).
    # HEAD_GROUP (a runtime argument, no recompile): heads whose query blocks are interleaved longest-first (see
    # the kernel); lowered to the largest divisor of H at most it.
    # Measured on an H200 at the M1 8k prefill (kernels_bench prefill_sweep, 2026-11-29): 128x128 tiles with
    # two stages 715 us, the 128x64 three-stage tiles 734 us (Q 48 KB + (48 + 32 KB) x 2 = 208 KB shared).
    if Dqk <= 192 and Dv <= 128:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, HEAD_GROUP=4)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, HEAD_GROUP=4)


def split_head_dim(Dqk: int) -> tuple[int, int, int]:
    """(D1, D2, BLOCK_D2): D1 the largest power of two <= Dqk (>= 16), D2 the rest, padded to >= 16."""
    d1 = max(16, 1 << (Dqk.bit_length() - 1))
    d2 = max(0, Dqk - d1)
    return d1, d2, max(16, _pow2(d2)) if d2 else 16


def _head_group(H: int, want: int) -> int:
    g = max(1, min(H, int(want)))
    while H % g:
        g -= 1
    return g


def prefill_attention_mla(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_q_len: int,
    config: dict | None = None,
) -> torch.Tensor:
    """Attention with k = [k_nope | k_rope] read from two sources. q [Tp, H, N+P], k_nope [C, H, N], k_rope [C, P]
    (shared by all heads) or [C, H, P], v [C, H, Dv], cu_q/cu_k [B+1] int32 -> out [Tp, H, Dv]. Any strides with a
    unit last stride. Needs klen >= qlen per request (the caller's contract; not checked on device)."""
    Tp, H, Dqk = q.shape
    C, N = k_nope.shape[0], k_nope.shape[-1]
    P = k_rope.shape[-1]
    Dv = v.shape[-1]
    rope_ok = k_rope.shape == (C, P) or k_rope.shape == (C, H, P)
    if k_nope.shape != (C, H, N) or not rope_ok or N + P != Dqk or v.shape[:2] != (C, H) or out.shape != (Tp, H, Dv):
        raise ValueError(
            f"shapes q {tuple(q.shape)} k_nope {tuple(k_nope.shape)} k_rope {tuple(k_rope.shape)} "
            f"v {tuple(v.shape)} out {tuple(out.shape)} must be [Tp,H,N+P] [C,H,N] [C,P] or [C,H,P] "
            "[C,H,Dv] [Tp,H,Dv]"
        )
    if any(t.stride(-1) != 1 for t in (q, k_nope, k_rope, v, out)):
        raise ValueError("q, k_nope, k_rope, v and out need a unit stride in their last dim")
    if not (q.dtype == k_nope.dtype == k_rope.dtype == v.dtype) or q.dtype not in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
    ):
        raise ValueError(
            f"q/k_nope/k_rope/v dtypes {q.dtype}/{k_nope.dtype}/{k_rope.dtype}/{v.dtype} must match (bf16/fp16/fp32)"
        )
    if not (1 <= N <= 512 and 0 <= P <= 256 and 1 <= Dv <= 256):
        raise ValueError(f"head dims N={N} (1..512) P={P} (0..256) Dv={Dv} (1..256) out of range")
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32 or cu_q.shape != cu_k.shape:
        raise ValueError("cu_q and cu_k must be int32 [B+1]")
    B = cu_q.shape[0] - 1
    if Tp == 0 or B == 0 or max_q_len == 0:
        return out
    cfg = dict(prefill_config(Dqk, Dv, q.dtype), **(config or {}))
    g = _head_group(H, cfg["HEAD_GROUP"])
    num_mb = triton.cdiv(max_q_len, cfg["BLOCK_M"])
    k2h = k_rope.stride(1) if k_rope.dim() == 3 else 0
    _prefill_attention_kernel[(B * H * num_mb,)](
        q,
        k_nope,
        k_rope,
        v,
        out,
        cu_q,
        cu_k,
        scale * LOG2E,
        num_mb,
        q.stride(0),
        q.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        k_rope.stride(0),
        k2h,
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        H,
        g,
        D1=N,
        BLOCK_D1=max(16, _pow2(N)),
        D2=P,
        BLOCK_D2=max(16, _pow2(P)),
        DV=Dv,
        BLOCK_DV=max(16, _pow2(Dv)),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_q_len: int,
    config: dict | None = None,
) -> torch.Tensor:
    """q [Tp, H, Dqk], k [C, H, Dqk], v [C, H, Dv], cu_q/cu_k [B+1] int32 -> out [Tp, H, Dv] (any strides with a
    unit last stride): prefill_attention_mla with k split at the largest power of two <= Dqk."""
    Tp, H, Dqk = q.shape
    if k.dim() != 3 or k.shape[1:] != (H, Dqk) or v.shape[:2] != k.shape[:2] or out.shape != (Tp, H, v.shape[-1]):
        raise ValueError(
            f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} out {tuple(out.shape)} "
            "must be [Tp,H,Dqk] [C,H,Dqk] [C,H,Dv] [Tp,H,Dv]"
        )
    if Dqk < 16 or Dqk > 512:
        raise ValueError(f"head dim Dqk={Dqk} out of range (16..512)")
    d1 = split_head_dim(Dqk)[0]
    return prefill_attention_mla(q, k[..., :d1], k[..., d1:], v, cu_q, cu_k, scale, out, max_q_len, config)


def prefill_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_q_len: int,
) -> torch.Tensor:
    """The same contract through torch SDPA, one request at a time (reads cu_q/cu_k on the host: a sync;
    for comparison and eager fallback, not for CUDA graphs)."""
    from torch.nn.attention.bias import causal_lower_right

    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        n, L = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if n == 0:
            continue
        qb = q[cq[b] : cq[b + 1]].transpose(0, 1)  # [H, n, Dqk]
        kb, vb = k[ck[b] : ck[b + 1]].transpose(0, 1), v[ck[b] : ck[b + 1]].transpose(0, 1)
        if n == L:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=causal_lower_right(n, L), scale=scale)
        out[cq[b] : cq[b + 1]] = o.transpose(0, 1)
    return out
