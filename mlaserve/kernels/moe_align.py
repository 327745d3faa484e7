"""MoE align: lay the owned (token, k) pairs out per expert in padded blocks of BLOCK_M rows, for the grouped GEMMs.

No atomics and no host sync: each program takes a chunk of pairs, counts them per expert with one-hot sums and ranks
them by a one-hot cumsum, so the layout is a stable sort (pairs in index order inside each expert) and deterministic.
Up to FUSED_COUNT_MAX pairs one program does everything (one launch: decode, verify). Above it a histogram kernel
writes per-chunk expert counts and the align kernel, one program per chunk, sums them (every program redundantly:
the counts are small) into the padded expert starts plus its chunk's offset inside each expert, then scatters its
chunk, a slice of the block -> expert ids and a slice of the experts' padding. Buffers are sized from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_start

# Up to 128 one-hot lanes (M1's 64 experts): one program up to FUSED_COUNT_MAX (token, k) pairs, above it chunks of
# ALIGN_CHUNK pairs, grown (up to 512) to keep at most 64 programs, and one-hot tiles of 128 pairs: the align is a
# chain of dependent steps, so fewer, wider steps and more programs win (docs/experiments.md, MoE: 48e0d60).
FUSED_COUNT_MAX = 128
ALIGN_CHUNK = 64
# More lanes (Kimi: 384 experts): MANY_FUSED_MAX / MANY_CHUNK divided by lanes / 64, tiles of 4k one-hot elements.
MANY_FUSED_MAX = 1024
MANY_CHUNK = 512


@triton.jit
def _local_experts(TopkIds, offs, TK, expert_offset, E_LOCAL):
    """Local expert of each pair, -1 where the pair is past the end or its expert is not owned."""
    e = (tl.load(TopkIds + offs, mask=offs < TK, other=-1) - expert_offset).to(tl.int32)
    return tl.where((offs < TK) & (e >= 0) & (e < E_LOCAL), e, -1)


@triton.jit
def _chunk_hist(TopkIds, start, length, TK, expert_offset, E_LOCAL, BLOCK_E: tl.constexpr, SUB: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    hist = tl.zeros([BLOCK_E], tl.int32)
    for s0 in range(0, length, SUB):
        e = _local_experts(TopkIds, start + s0 + tl.arange(0, SUB), TK, expert_offset, E_LOCAL)
        hist += tl.sum((e[:, None] == offs_e[None, :]).to(tl.int32), 0)
    return hist


@triton.jit(do_not_specialize=["TK", "expert_offset"])
def _moe_hist_kernel(
    TopkIds,
    Partial,
    TK,
    expert_offset,
    E_LOCAL,
    BLOCK_E: tl.constexpr,
    SUB: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Partial[p, e] = number of pairs of chunk p routed to local expert e."""
    pdl_start(PDL)
    p = tl.program_id(0)
    hist = _chunk_hist(TopkIds, p * CHUNK, CHUNK, TK, expert_offset, E_LOCAL, BLOCK_E, SUB)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(Partial + p * E_LOCAL + offs_e, hist, mask=offs_e < E_LOCAL)


@triton.jit(do_not_specialize=["TK", "NT", "expert_offset", "num_chunks", "max_blocks", "max_padded", "max_padded_t"])
def _moe_align_kernel(
    TopkIds,
    Partial,
    SortedIds,
    ExpertIds,
    NumPadded,
    SortedT,
    ExpertT,
    NumT,
    TK,
    NT,
    expert_offset,
    E_LOCAL,
    num_chunks,
    max_blocks,
    max_padded,
    max_padded_t,
    SHARED: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SUB: tl.constexpr,
    CHUNK: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PAD_E: tl.constexpr,
    PDL: tl.constexpr,
):
    """SINGLE: one program, all TK pairs, counting them itself. Else program p owns chunk p of Partial's counts.
    SHARED: the last SHARED slots of each of the NT rows name experts E_LOCAL .. E_LOCAL + SHARED - 1, one each in
    order (the router's fused shared experts); they are laid out after the counted experts by arithmetic alone.
    TAIL: an expert's rows in half blocks (HALF = BLOCK_M / 2 rows); pairs of them are its BLOCK_M-row blocks here,
    an odd last one goes to SortedT / ExpertT / NumT (the tail list, blocks of HALF rows), so its last rows pad to
    HALF instead of BLOCK_M (171 rows: 128 + 64 rows, not 256)."""
    pdl_start(PDL)
    p = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E_LOCAL
    if SINGLE:
        start = 0
        length = TK
        cnt = _chunk_hist(TopkIds, 0, TK, TK, expert_offset, E_LOCAL, BLOCK_E, SUB)
        before = tl.zeros([BLOCK_E], tl.int32)  # pairs of earlier chunks, per expert
    else:
        start = p * CHUNK
        length = CHUNK
        cnt = tl.zeros([BLOCK_E], tl.int32)
        before = tl.zeros([BLOCK_E], tl.int32)
        for q0 in range(0, num_chunks, BLOCK_Q):
            q = q0 + tl.arange(0, BLOCK_Q)
            part = tl.load(
                Partial + q[:, None] * E_LOCAL + offs_e[None, :],
                mask=(q < num_chunks)[:, None] & e_ok[None, :],
                other=0,
            )
            cnt += tl.sum(part, 0)
            before += tl.sum(tl.where((q < p)[:, None], part, 0), 0)
    HALF: tl.constexpr = BLOCK_M // 2
    if TAIL:
        halves = (cnt + HALF - 1) // HALF
        padded = halves // 2 * BLOCK_M  # rows in the main list; an odd last half block is the tail's
        padded_t = halves % 2 * HALF
        ends_t = tl.cumsum(padded_t, 0)
        starts_t = ends_t - padded_t
        tl.store(NumT, tl.sum(padded_t, 0), mask=p == 0)
    else:
        padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)  # the counted experts' rows; the shared experts' follow, NT padded a shared expert
    pad_nt = (NT + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(NumPadded, total + SHARED * pad_nt, mask=p == 0)
    # Block -> expert: the number of experts whose padded range ends at or before the block's first row.
    for b0 in range(p * BLOCK_B, max_blocks, nprog * BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        x = blk * BLOCK_M
        eid = tl.sum(((ends[None, :] <= x[:, None]) & e_ok[None, :]).to(tl.int32), 1)
        if SHARED:
            eid = tl.where(x < total, eid, E_LOCAL + (x - total) // tl.maximum(pad_nt, 1))
        tl.store(ExpertIds + blk, tl.where(x < total + SHARED * pad_nt, eid, -1), mask=blk < max_blocks)
    if TAIL:  # the tail list's blocks: one an expert at most, so at most max_padded_t / HALF of them
        for b0 in range(p * BLOCK_B, max_padded_t // HALF, nprog * BLOCK_B):
            blk = b0 + tl.arange(0, BLOCK_B)
            x = blk * HALF
            eid = tl.sum(((ends_t[None, :] <= x[:, None]) & e_ok[None, :]).to(tl.int32), 1)
            tl.store(ExpertT + blk, tl.where(x < tl.sum(padded_t, 0), eid, -1), mask=blk < max_padded_t // HALF)
    # Each expert's padding rows [start + count, end) get the sentinel TK (an invalid pair index).
    if SINGLE:  # one program: sentinel everywhere first (cheap stores), the pairs overwrite their rows below
        for i0 in range(0, max_padded, 1024):
            offs = i0 + tl.arange(0, 1024)
            tl.store(SortedIds + offs, tl.zeros([1024], tl.int32) + TK, mask=offs < max_padded)
        if TAIL:
            for i0 in range(0, max_padded_t, 1024):
                offs = i0 + tl.arange(0, 1024)
                tl.store(SortedT + offs, tl.zeros([1024], tl.int32) + TK, mask=offs < max_padded_t)
        tl.debug_barrier()
    else:  # many programs: each fills the padding of a slice of experts (no ordering between programs needed)
        fill_end = starts + tl.minimum(cnt, padded)
        for e0 in range(p * PAD_E, E_LOCAL, nprog * PAD_E):
            sel = (e0 + tl.arange(0, PAD_E))[:, None] == offs_e[None, :]  # [PAD_E, BLOCK_E]: gather by one-hot
            lo = tl.sum(tl.where(sel, fill_end[None, :], 0), 1)
            hi = tl.sum(tl.where(sel, ends[None, :], 0), 1)
            pos = lo[:, None] + tl.arange(0, BLOCK_M)[None, :]
            tl.store(SortedIds + pos, tl.zeros([PAD_E, BLOCK_M], tl.int32) + TK, mask=pos < hi[:, None])
            if TAIL:
                lo = tl.sum(tl.where(sel, (starts_t + cnt - tl.minimum(cnt, padded))[None, :], 0), 1)
                hi = tl.sum(tl.where(sel, ends_t[None, :], 0), 1)
                pos = lo[:, None] + tl.arange(0, HALF)[None, :]
                tl.store(SortedT + pos, tl.zeros([PAD_E, HALF], tl.int32) + TK, mask=pos < hi[:, None])
        if SHARED:  # the shared experts' padding rows, by program 0
            for j in tl.static_range(SHARED):
                sh_pos = total + j * pad_nt + NT + tl.arange(0, BLOCK_M)
                tl.store(
                    SortedIds + sh_pos,
                    tl.zeros([BLOCK_M], tl.int32) + TK,
                    mask=(sh_pos < total + (j + 1) * pad_nt) & (p == 0),
                )
    if SHARED:  # shared expert j's row t is pair t * K + (K - SHARED) + j, for a slice of the tokens a program
        K = TK // tl.maximum(NT, 1)
        for t0 in range(p * 1024, NT, nprog * 1024):
            t = t0 + tl.arange(0, 1024)
            for j in tl.static_range(SHARED):
                tl.store(SortedIds + total + j * pad_nt + t, t * K + (K - SHARED) + j, mask=t < NT)
    # This chunk's pairs: row = expert start + pairs before this chunk + rank inside the chunk (one-hot cumsum).
    if TAIL:  # rank r inside the expert: row starts + r while r < its main rows, else the tail's row
        carry = before
        for s0 in range(0, length, SUB):
            offs = start + s0 + tl.arange(0, SUB)
            e = _local_experts(TopkIds, offs, TK, expert_offset, E_LOCAL)
            oh = (e[:, None] == offs_e[None, :]).to(tl.int32)  # [SUB, BLOCK_E]
            r = tl.sum(oh * (tl.cumsum(oh, 0) - 1 + carry[None, :]), 1)
            main = tl.sum(oh * padded[None, :], 1)
            tl.store(SortedIds + tl.sum(oh * starts[None, :], 1) + r, offs, mask=(e >= 0) & (r < main))
            tl.store(SortedT + tl.sum(oh * starts_t[None, :], 1) + r - main, offs, mask=(e >= 0) & (r >= main))
            carry += tl.sum(oh, 0)
    else:
        carry = starts + before
        for s0 in range(0, length, SUB):
            offs = start + s0 + tl.arange(0, SUB)
            e = _local_experts(TopkIds, offs, TK, expert_offset, E_LOCAL)
            oh = (e[:, None] == offs_e[None, :]).to(tl.int32)  # [SUB, BLOCK_E]
            pos = tl.sum(oh * (tl.cumsum(oh, 0) - 1 + carry[None, :]), 1)
            tl.store(SortedIds + pos, offs, mask=e >= 0)
            carry += tl.sum(oh, 0)


def moe_align(
    topk_ids: torch.Tensor,
    E_local: int,
    expert_offset: int,
    block_m: int,
    *,
    fused_max: int | None = None,
    chunk: int | None = None,
    shared: int = 0,
    sub: int | None = None,
    num_warps: int | None = None,
    pdl: bool = True,
    tail: bool = False,
):
    """-> (sorted_ids [max_padded] int32, expert_ids [max_blocks] int32 (-1 past the end), num_padded [1] int32).
    max_padded = T*K + min(E_local, T*K) * (block_m - 1) bounds the padded total for any routing; sorted_ids past
    num_padded hold the sentinel (one program) or are left unwritten (many). fused_max / chunk (tests) override
    FUSED_COUNT_MAX / ALIGN_CHUNK (above 128 one-hot lanes MANY_FUSED_MAX / MANY_CHUNK, both divided by
    next_pow2(E_local) / 64); sub (pairs a one-hot tile, a power of 2) and num_warps (benchmarks) override the tiles.
    shared: the last `shared` slots of every row of topk_ids name local experts E_local - shared .. E_local - 1 in
    order (the router's fused shared experts, routing.py): they are placed without counting, so the one-hot tiles
    span E_local - shared experts. tail: the tail list's three follow (sorted_t [min(E_local, T*K) * block_m/2],
    expert_t, num_t), each expert's odd last half block (its last rows, at most block_m/2 of them) there instead of
    padded to block_m rows in the main list."""
    TK = topk_ids.numel()
    dev = topk_ids.device
    if block_m & (block_m - 1) or (chunk is not None and chunk & (chunk - 1)):
        raise ValueError(f"moe_align block_m={block_m} and chunk={chunk} must be powers of 2")
    if tail and (shared or block_m < 2):
        raise ValueError(f"moe_align tail needs shared=0 (got {shared}) and block_m >= 2 (got {block_m})")
    max_padded = TK + min(E_local, TK) * (block_m - 1)
    max_blocks = triton.cdiv(max_padded, block_m)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    lists = (sorted_ids, expert_ids, num_padded)
    max_padded_t = min(E_local, TK) * (block_m // 2) if tail else 0  # tail blocks: one an expert at most
    if tail:
        lists += (
            torch.empty(max_padded_t, dtype=torch.int32, device=dev),
            torch.empty(max_padded_t // (block_m // 2), dtype=torch.int32, device=dev),
            torch.empty(1, dtype=torch.int32, device=dev),
        )
    if TK == 0:
        for n in lists[2::3]:
            n.zero_()
        return lists
    ids = topk_ids.reshape(-1)
    NT = topk_ids.shape[0] if topk_ids.dim() == 2 else TK
    if shared and (topk_ids.dim() != 2 or shared >= E_local or shared > topk_ids.shape[-1]):
        raise ValueError(f"moe_align shared={shared} needs topk_ids [T, K] with K >= shared and E_local > shared")
    E_local = E_local - shared  # the experts counted; the shared ones follow them
    block_e = triton.next_power_of_2(E_local)
    if block_e <= 128:
        single = TK <= (FUSED_COUNT_MAX if fused_max is None else fused_max)
        chunk = ALIGN_CHUNK if chunk is None else chunk
        chunk = max(16, chunk, min(512, triton.next_power_of_2(triton.cdiv(TK, 64))))  # <= 64 programs to 512 a chunk
        sub = sub or 128  # one-hot tiles [128, BLOCK_E]
    else:
        # The one-hot work of a pair grows with the expert count: with many experts (Kimi: 384) fewer pairs stay in
        # one program and the chunks shrink (H200: one program for 512 pairs x 512 one-hot lanes took 86 us).
        scale = block_e // 64
        single = TK <= (MANY_FUSED_MAX if fused_max is None else fused_max) // scale
        chunk = MANY_CHUNK if chunk is None else chunk
        if triton.cdiv(TK, max(16, chunk // scale)) <= 64:  # but never past 64 chunks: every program sums all the
            chunk = max(16, chunk // scale)  # chunk counts (Kimi 8k prefill: 1024 chunks took 0.8 ms)
        sub = sub or max(16, 4096 // block_e)  # one-hot tiles [SUB, BLOCK_E] of 4k elements
    warps = num_warps or (4 if block_e <= 128 else 8)
    pdl = pdl_args(ids, pdl)
    if single:
        num_chunks, sub = 1, min(sub, max(16, triton.next_power_of_2(TK)))
        partial = num_padded  # unused
    else:
        sub = min(sub, chunk)
        num_chunks = triton.cdiv(TK, chunk)
        partial = torch.empty(num_chunks, E_local, dtype=torch.int32, device=dev)
        _moe_hist_kernel[(num_chunks,)](
            ids, partial, TK, expert_offset, E_local, BLOCK_E=block_e, SUB=sub, CHUNK=chunk, num_warps=warps, **pdl
        )
    _moe_align_kernel[(num_chunks,)](
        ids,
        partial,
        sorted_ids,
        expert_ids,
        num_padded,
        *(lists[3:] if tail else (num_padded,) * 3),  # unused without tail
        TK,
        NT,
        expert_offset,
        E_local,
        num_chunks,
        max_blocks,
        max_padded,
        max_padded_t,
        SHARED=shared,
        TAIL=tail,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        SUB=sub,
        CHUNK=chunk,
        SINGLE=single,
        BLOCK_Q=max(4, min(64, 4096 // block_e)),
        BLOCK_B=64,
        PAD_E=16,
        num_warps=warps,
        **pdl,
    )
    return lists
