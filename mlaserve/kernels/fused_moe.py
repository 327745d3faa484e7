"""Fused MoE experts: align (token, k) pairs into per-expert blocks, grouped GEMM1 with SiLU(gate)*up fused,
grouped GEMM2 with the top-k weight fused, then the sum over k. No host sync; buffers sized from shapes only.

Align: each owned (token, k) pair gets its rank inside its expert by atomic increments (in the align program itself
up to FUSED_COUNT_MAX pairs, else in a separate counting kernel); one program then lays the experts out in padded
blocks of BLOCK_M rows (sentinel T*K in the padding) and writes each block's expert.
Row order inside an expert depends on atomic order, but every row's output does not, so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_config import moe_config

FUSED_COUNT_MAX = 4096  # up to this many (token, k) pairs one program also does the counting (decode, verify)


@triton.jit
def _count_chunk(TopkIds, Counts, Rank, offs, TK, expert_offset, E_LOCAL):
    """Each owned (token, k) pair's rank inside its expert, by atomic increments of the expert's count."""
    e = (tl.load(TopkIds + offs, mask=offs < TK, other=-1) - expert_offset).to(tl.int32)
    own = (offs < TK) & (e >= 0) & (e < E_LOCAL)
    r = tl.atomic_add(Counts + e, 1, mask=own)
    tl.store(Rank + offs, r, mask=own)


@triton.jit(do_not_specialize=["TK", "expert_offset"])
def _moe_count_kernel(TopkIds, Counts, Rank, TK, expert_offset, E_LOCAL, BLOCK: tl.constexpr):
    _count_chunk(TopkIds, Counts, Rank, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), TK, expert_offset, E_LOCAL)


@triton.jit(do_not_specialize=["TK", "expert_offset", "max_padded", "max_blocks"])
def _moe_align_kernel(TopkIds, Counts, Rank, Ends, SortedIds, ExpertIds, NumPadded,
                      TK, expert_offset, E_LOCAL, max_padded, max_blocks,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, LOG2_E: tl.constexpr, BLOCK: tl.constexpr,
                      FUSED_COUNT: tl.constexpr):
    """One program. FUSED_COUNT (small T*K): count here too, saving the memset and the count launch."""
    if FUSED_COUNT:
        for e0 in range(0, E_LOCAL, BLOCK):
            tl.store(Counts + e0 + tl.arange(0, BLOCK), 0, mask=e0 + tl.arange(0, BLOCK) < E_LOCAL)
        tl.debug_barrier()
        for i0 in range(0, TK, BLOCK):
            _count_chunk(TopkIds, Counts, Rank, i0 + tl.arange(0, BLOCK), TK, expert_offset, E_LOCAL)
        tl.debug_barrier()
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E_LOCAL
    cnt = tl.load(Counts + offs_e, mask=e_ok, other=0, cache_modifier=".cg")
    padded = tl.cdiv(cnt, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(NumPadded, total)
    tl.store(Ends + offs_e, ends, mask=e_ok)
    for i0 in range(0, max_padded, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        tl.store(SortedIds + offs, TK, mask=offs < max_padded)  # sentinel: an invalid (token, k) index
    tl.debug_barrier()
    # Block i belongs to the first expert whose padded end exceeds i * BLOCK_M (binary search over Ends).
    for i0 in range(0, max_blocks, BLOCK):
        blk = i0 + tl.arange(0, BLOCK)
        x = blk * BLOCK_M
        lo = tl.zeros([BLOCK], tl.int32)
        hi = tl.zeros([BLOCK], tl.int32) + E_LOCAL
        for _ in tl.static_range(LOG2_E + 1):
            active = lo < hi
            mid = (lo + hi) // 2
            v = tl.load(Ends + mid, mask=active, other=0, cache_modifier=".cg")
            right = active & (v <= x)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & (v > x), mid, hi)
        tl.store(ExpertIds + blk, tl.where(x < total, lo, -1), mask=blk < max_blocks)
    for i0 in range(0, TK, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        e = (tl.load(TopkIds + offs, mask=offs < TK, other=-1) - expert_offset).to(tl.int32)
        own = (offs < TK) & (e >= 0) & (e < E_LOCAL)
        cnt_e = tl.load(Counts + e, mask=own, other=0, cache_modifier=".cg")
        start = tl.load(Ends + e, mask=own, other=0, cache_modifier=".cg") - tl.cdiv(cnt_e, BLOCK_M) * BLOCK_M
        r = tl.load(Rank + offs, mask=own, other=0, cache_modifier=".cg")
        tl.store(SortedIds + start + r, offs, mask=own)


@triton.jit
def _pid_to_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks share each weight tile while it is in L2."""
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size
    pid_n = (pid % (GROUP_M * num_n)) // size
    return pid_m, pid_n


@triton.jit(do_not_specialize=["num_m", "TK"])
def _moe_gemm1_kernel(X, W13, Hbuf, SortedIds, ExpertIds, NumPadded,
                      I, D, num_m, stride_xt, stride_we, stride_wn, stride_hm, TK,
                      TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """Hbuf[m, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for the padded row m of expert e."""
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    e = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(SortedIds + offs_m)
    row_ok = ids < TK
    tok = (ids // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = X + tok[:, None] * stride_xt + offs_k[None, :]
    g_ptr = W13 + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K, N] view
    u_ptr = g_ptr + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptr, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptr, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < D - k0
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PREC)
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    h_ptr = Hbuf + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptr, h.to(Hbuf.dtype.element_ty), mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_m", "TK"])
def _moe_gemm2_kernel(Hbuf, W2, Y, SortedIds, ExpertIds, NumPadded, TopkW,
                      D, I, num_m, stride_hm, stride_we, stride_wn, stride_yt, TK,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """Y[(t, k)] = topk_weight[t, k] * (Hbuf[m] . w2[e])  for every real row m of expert e's blocks."""
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), num_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    e = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(SortedIds + offs_m)
    row_ok = ids < TK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = Hbuf + offs_m.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]
    b_ptr = W2 + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K, N] view
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr)
            b = tl.load(b_ptr, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < I - k0
            a = tl.load(a_ptr, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    w = tl.load(TopkW + ids, mask=row_ok, other=0.0)
    acc = acc * w[:, None]
    y_ptr = Y + ids.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["expert_offset"])
def _moe_sum_kernel(Y, TopkIds, Out, D, expert_offset, E_LOCAL, TOPK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Out[t] = sum over k of Y[(t, k)], skipping experts this rank does not own (their rows were never written)."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for k in tl.static_range(TOPK):
        e = tl.load(TopkIds + t * TOPK + k) - expert_offset
        if (e >= 0) & (e < E_LOCAL):
            acc += tl.load(Y + (t * TOPK + k).to(tl.int64) * D + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + t.to(tl.int64) * D + offs, acc.to(Out.dtype.element_ty), mask=ok)


def moe_align(topk_ids: torch.Tensor, E_local: int, expert_offset: int, block_m: int):
    """-> (sorted_ids [max_padded] int32, expert_ids [max_blocks] int32 (-1 past the end), num_padded [1] int32).
    max_padded = T*K + min(E_local, T*K) * (block_m - 1) bounds the padded total for any routing."""
    TK = topk_ids.numel()
    dev = topk_ids.device
    max_padded = TK + min(E_local, TK) * (block_m - 1)
    max_blocks = triton.cdiv(max_padded, block_m)
    fused_count = TK <= FUSED_COUNT_MAX
    counts = (torch.empty if fused_count else torch.zeros)(E_local, dtype=torch.int32, device=dev)
    rank = torch.empty(TK, dtype=torch.int32, device=dev)
    ends = torch.empty(E_local, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    if not fused_count:
        _moe_count_kernel[(triton.cdiv(TK, 1024),)](ids, counts, rank, TK, expert_offset, E_local, BLOCK=1024)
    block_e = triton.next_power_of_2(E_local)
    _moe_align_kernel[(1,)](ids, counts, rank, ends, sorted_ids, expert_ids, num_padded,
                            TK, expert_offset, E_local, max_padded, max_blocks,
                            BLOCK_M=block_m, BLOCK_E=block_e, LOG2_E=block_e.bit_length() - 1, BLOCK=1024,
                            FUSED_COUNT=fused_count, num_warps=8)
    return sorted_ids, expert_ids, num_padded


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_offset: int = 0, config: dict | None = None) -> torch.Tensor:
    """sum_k w[t,k] * down(silu(gate(x)) * up(x)) over experts [offset, offset + E_local); equals
    layers.moe.fused_experts_ref. x [T, D]; w13 [E_local, 2I, D]; w2 [E_local, D, I]; topk_weights [T, K] fp32;
    topk_ids [T, K] int -> [T, D] in x.dtype."""
    T, D = x.shape
    E, I2, D1 = w13.shape
    I = I2 // 2
    K = topk_ids.shape[-1]
    if D1 != D or w2.shape != (E, D, I) or I2 != 2 * I:
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} must be [E, 2I, {D}] / [E, {D}, I]")
    if topk_ids.shape != (T, K) or topk_weights.shape != (T, K) or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_ids/topk_weights must be [{T}, K] (weights fp32), got {tuple(topk_ids.shape)} "
                         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(f"x {x.dtype}, w13 {w13.dtype} and w2 {w2.dtype} must share a dtype")
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("x, w13 and w2 need a unit stride in their last dim")
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    c1, c2 = moe_config(T, K, E, D, I, x.dtype, **(config or {}))
    bm = c1["BLOCK_M"]
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, E, expert_offset, bm)
    max_padded, num_m = sorted_ids.shape[0], expert_ids.shape[0]
    TK = T * K
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    hbuf = torch.empty(max_padded, I, dtype=x.dtype, device=x.device)
    _moe_gemm1_kernel[(num_m * triton.cdiv(I, c1["BLOCK_N"]),)](
        x, w13, hbuf, sorted_ids, expert_ids, num_padded, I, D, num_m,
        x.stride(0), w13.stride(0), w13.stride(1), hbuf.stride(0), TK,
        TOPK=K, BLOCK_M=bm, BLOCK_N=c1["BLOCK_N"], BLOCK_K=c1["BLOCK_K"], GROUP_M=c1["GROUP_M"],
        EVEN_K=D % c1["BLOCK_K"] == 0, DOT_PREC=prec, num_warps=c1["num_warps"], num_stages=c1["num_stages"])
    y = torch.empty(TK, D, dtype=x.dtype, device=x.device)
    _moe_gemm2_kernel[(num_m * triton.cdiv(D, c2["BLOCK_N"]),)](
        hbuf, w2, y, sorted_ids, expert_ids, num_padded, topk_weights.reshape(-1),
        D, I, num_m, hbuf.stride(0), w2.stride(0), w2.stride(1), y.stride(0), TK,
        BLOCK_M=bm, BLOCK_N=c2["BLOCK_N"], BLOCK_K=c2["BLOCK_K"], GROUP_M=c2["GROUP_M"],
        EVEN_K=I % c2["BLOCK_K"] == 0, DOT_PREC=prec, num_warps=c2["num_warps"], num_stages=c2["num_stages"])
    block_d = min(1024, triton.next_power_of_2(D))
    _moe_sum_kernel[(T, triton.cdiv(D, block_d))](y, topk_ids, out, D, expert_offset, E, TOPK=K, BLOCK_D=block_d,
                                                    num_warps=4)
    return out
