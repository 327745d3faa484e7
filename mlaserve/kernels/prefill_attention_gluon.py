"""MLA prefill attention in Gluon (Hopper): each query block's two halves run as two warp-specialized partitions,
so one half's softmax runs while the tensor cores serve the other's MMAs.

prefill_attention.py's Triton kernel computes each key tile's scores, waits for them, takes their softmax and then
multiplies by V; its 8 warps meet at a CTA barrier every tile, so the tensor cores idle during every softmax (one
program an SM: 208 KB of shared memory). Here a program's 128 query rows are two warpgroups of 64 rows, each its
own partition (`gl.warp_specialize`), synchronised only through mbarriers: a K/V slot is "ready" when its TMA
load lands and "empty" when both warpgroups have released it. Nothing holds them in step, so they drift apart and
one's softmax overlaps the other's MMAs (FlashAttention-3's ping-pong, here left to the scheduler). Within a
warpgroup, tile j's scores and tile j-1's P @ V are issued together and the scores waited with P @ V in flight
(`warpgroup_mma_wait(1)`), the softmax written before P @ V's wait (FlashAttention-3's intra-warpgroup order);
ptxas still moves that wait above the softmax here (the SASS shows it), so the overlap comes from the two
partitions. Warpgroup 0 issues the loads at the top of each step, where neither has an MMA in flight: any branch
or barrier (an mbarrier arrive lowers with one) between a wgmma and its wait makes ptxas wait for it there.

Same contract as `prefill_attention_mla` (bottom-right causal, k = [k_nope | k_rope] from two sources), for
MLA's head dims only: N = 128, P = 64, Dv = 128, bf16. Q, K and V tiles are loaded by TMA from 2-D descriptors
over [tokens, heads * head stride] (any token and head strides a TMA can address). The MMAs, their K order and the
softmax's operations per row are the Triton kernel's (which also accumulates P @ V into the rescaled output), so
the two give the same bits; the GPU tests hold them equal.
"""

from __future__ import annotations

import functools

import torch

from .prefill_attention import program_tile, request_rows

try:  # Gluon's Hopper API as Triton 3.6 names it; other versions fall back to the Triton kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

LOG2E = 1.4426950408889634
HEAD_DIMS = (128, 64, 128)  # (N, P, Dv): MLA's k_nope, k_rope and v widths, the only ones this kernel takes
BLOCK_M = 128  # query rows a program: two warpgroups of wgmma's 64
WORKER_REGS = 232  # registers a thread of the second warpgroup's partition


if AVAILABLE:

    @gluon.jit
    def _load_k(k1_desc, k2_desc, bar, k1_buf, k2_buf, row, col1, col2):
        mbarrier.expect(bar, k1_desc.block_type.nbytes + k2_desc.block_type.nbytes)
        _tma_load(k1_desc, [row, col1], bar, k1_buf)
        _tma_load(k2_desc, [row, col2], bar, k2_buf)

    @gluon.jit
    def _load_v(v_desc, bar, v_buf, row, col):
        mbarrier.expect(bar, v_desc.block_type.nbytes)
        _tma_load(v_desc, [row, col], bar, v_buf)

    @gluon.jit
    def _softmax(s, m_i, l_i, n0, q_pos, klen, scale_log2, offs_n, MASKED: gl.constexpr):
        """Tile n0's scores s [ROWS, N] (fp32) -> (p, alpha, m, l): FlashAttention's online softmax, the scale folded
        into exp2's argument; MASKED tiles mask the keys past each row's position or past klen."""
        if MASKED:
            pos = n0 + offs_n
            s = gl.where((pos[None, :] <= q_pos[:, None]) & (pos < klen)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _issue(j, n_tiles, descs, smem, bars, geo):
        """Warpgroup 0 at the top of step j: K_{j+1} into slot (j+1) % 2 once both warpgroups released K_{j-1},
        V_j into slot j % 2 once both released V_{j-2}: each a step ahead of its use."""
        k1_desc, k2_desc, v_desc = descs
        q1_s, q2_s, k1_s, k2_s, v_s = smem
        q_bar, k_ready, k_empty, v_ready, v_empty = bars
        k0, c1, c2, cv = geo
        BLOCK_N: gl.constexpr = k1_desc.block_type.shape[0]
        if j + 1 < n_tiles:
            t = j + 1
            mbarrier.wait(k_empty.index(t % 2), ((t - 2) // 2) & 1)
            _load_k(
                k1_desc, k2_desc, k_ready.index(t % 2), k1_s.index(t % 2), k2_s.index(t % 2), k0 + t * BLOCK_N, c1, c2
            )
        if j >= 2:
            mbarrier.wait(v_empty.index(j % 2), ((j - 2) // 2) & 1)
            _load_v(v_desc, v_ready.index(j % 2), v_s.index(j % 2), k0 + j * BLOCK_N, cv)

    @gluon.jit
    def _step(
        j, n_tiles, p, o, m_i, l_i, q1, q2, descs, smem, bars, geo, rowinfo, WG: gl.constexpr, MASKED: gl.constexpr
    ):
        """Key tile j (1 <= j < n_tiles) for one warpgroup: tile j's scores and tile j-1's P @ V (p) issued
        together, the scores waited, tile j's softmax, the output rescaled. -> (tile j's P, o, m, l)."""
        k1_desc, k2_desc, v_desc = descs
        q1_s, q2_s, k1_s, k2_s, v_s = smem
        q_bar, k_ready, k_empty, v_ready, v_empty = bars
        s_zero, q_pos, klen, scale_log2, offs_n = rowinfo
        BLOCK_N: gl.constexpr = k1_desc.block_type.shape[0]
        p_layout: gl.constexpr = p.type.layout
        rows_o: gl.constexpr = gl.SliceLayout(1, o.type.layout)
        # V_{j-2}'s P @ V retired in the step before: released here, with no MMA in flight
        mbarrier.arrive(v_empty.index(j % 2), count=1, pred=j >= 2)
        if WG == 0:
            _issue(j, n_tiles, descs, smem, bars, geo)
        slot = j % 2
        prev = 1 - slot
        mbarrier.wait(k_ready.index(slot), (j // 2) & 1)
        s = warpgroup_mma(q1, k1_s.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q2, k2_s.index(slot).permute((1, 0)), s, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // 2) & 1)
        o = warpgroup_mma(p, v_s.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, q1, q2, k1_s.index(slot), k2_s.index(slot)))[0]
        mbarrier.arrive(k_empty.index(slot), count=1)
        p_new, alpha, m_i, l_i = _softmax(s, m_i, l_i, j * BLOCK_N, q_pos, klen, scale_log2, offs_n, MASKED)
        p_new = gl.convert_layout(p_new.to(p.dtype), p_layout)
        o, p_new, l_i, alpha = warpgroup_mma_wait(0, deps=(o, p_new, l_i, alpha, p, v_s.index(prev)))[:4]
        o = o * gl.convert_layout(alpha, rows_o)[:, None]
        return p_new, o, m_i, l_i

    @gluon.jit
    def _warpgroup(descs, smem, bars, geo, O, rows, WG: gl.constexpr):
        """Rows [ROWS * WG, ROWS * (WG + 1)) of the program's query block, over every key tile."""
        k1_desc, k2_desc, v_desc = descs
        q1_s, q2_s, k1_s, k2_s, v_s = smem
        q_bar, k_ready, k_empty, v_ready, v_empty = bars
        q0, qlen, klen, mb, h, n_tiles, n_full, scale_log2, stride_ot, stride_oh = rows
        BLOCK_M: gl.constexpr = q1_s.type.shape[0]
        ROWS: gl.constexpr = BLOCK_M // 2
        BLOCK_N: gl.constexpr = k1_desc.block_type.shape[0]
        DV: gl.constexpr = v_desc.block_type.shape[1]
        dtype: gl.constexpr = k1_desc.dtype
        # [ROWS, *] accumulators over the partition's 4 warps (16 rows each)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        q1 = q1_s.slice(WG * ROWS, ROWS, dim=0)
        q2 = q2_s.slice(WG * ROWS, ROWS, dim=0)

        offs_m = mb * BLOCK_M + WG * ROWS + gl.arange(0, ROWS, layout=rows_s)
        q_pos = klen - qlen + offs_m  # each query's position in its context
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_s)
        l_i = gl.zeros([ROWS], gl.float32, layout=rows_s)
        o = gl.zeros([ROWS, DV], gl.float32, layout=o_layout)
        rowinfo = (s_zero, q_pos, klen, scale_log2, offs_n)

        # tile 0: its scores alone
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q1, k1_s.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q2, k2_s.index(0).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, q1, q2, k1_s.index(0), k2_s.index(0)))[0]
        mbarrier.arrive(k_empty.index(0), count=1)
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, 0, q_pos, klen, scale_log2, offs_n, True)
        p = gl.convert_layout(p.to(dtype), p_layout)
        # the tiles before n_full need no mask: two loops, so neither has a branch inside
        for j in range(1, n_full):
            p, o, m_i, l_i = _step(j, n_tiles, p, o, m_i, l_i, q1, q2, descs, smem, bars, geo, rowinfo, WG, False)
        for j in range(n_full, n_tiles):
            p, o, m_i, l_i = _step(j, n_tiles, p, o, m_i, l_i, q1, q2, descs, smem, bars, geo, rowinfo, WG, True)
        last = (n_tiles - 1) % 2
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // 2) & 1)
        o = warpgroup_mma(p, v_s.index(last), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o, p, v_s.index(last)))[0]

        l_o = gl.convert_layout(l_i, rows_o)
        o = o / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
        offs_mo = mb * BLOCK_M + WG * ROWS + gl.arange(0, ROWS, layout=rows_o)
        offs_d = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
        o_ptr = O + (q0 + offs_mo).to(gl.int64)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        gl.store(o_ptr, o.to(dtype), mask=(offs_mo < qlen)[:, None] & (offs_d < DV)[None, :])

    @gluon.jit
    def _prefill_attention_gluon_kernel(
        q1_desc,
        q2_desc,
        k1_desc,
        k2_desc,
        v_desc,
        O,
        CuQ,
        CuK,
        scale_log2,
        num_mb,
        stride_qh,
        stride_k1h,
        stride_k2h,
        stride_vh,
        stride_ot,
        stride_oh,
        H,
        head_group,
        WORKER_REGS: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = q1_desc.block_type.shape[0]
        D1: gl.constexpr = q1_desc.block_type.shape[1]
        D2: gl.constexpr = q2_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k1_desc.block_type.shape[0]
        DV: gl.constexpr = v_desc.block_type.shape[1]
        dtype: gl.constexpr = q1_desc.dtype
        gl.static_assert(BLOCK_M == 128, "two warpgroups of wgmma's 64 query rows")

        b, mb, h = program_tile(gl.program_id(0), num_mb, H, head_group)  # the Triton kernel's order
        q0, qlen = request_rows(CuQ, b)
        if mb * BLOCK_M >= qlen:
            return
        k0, klen = request_rows(CuK, b)

        q1_s = gl.allocate_shared_memory(dtype, [BLOCK_M, D1], q1_desc.layout)
        q2_s = gl.allocate_shared_memory(dtype, [BLOCK_M, D2], q2_desc.layout)
        k1_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D1], k1_desc.layout)
        k2_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D2], k2_desc.layout)
        v_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DV], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one arrive a warpgroup
            mbarrier.init(v_empty.index(i), count=2)
        fence_async_shared()  # the initialised barriers visible to the TMA

        # keys up to the block's first query position are visible to every row: those tiles need no mask; past
        # the last row's position nothing is visible
        unmasked_end = ((klen - qlen + mb * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
        hi = klen - qlen + gl.minimum((mb + 1) * BLOCK_M, qlen)
        n_tiles = gl.cdiv(hi, BLOCK_N)
        n_full = gl.maximum(unmasked_end // BLOCK_N, 1)
        qrow = q0 + mb * BLOCK_M
        qcol = h * stride_qh
        c1 = h * stride_k1h
        c2 = h * stride_k2h  # 0: one k_rope for every head
        cv = h * stride_vh

        # Q, K_0, K_1, V_0, V_1; the warpgroups issue the rest
        mbarrier.expect(q_bar, q1_desc.block_type.nbytes + q2_desc.block_type.nbytes)
        _tma_load(q1_desc, [qrow, qcol], q_bar, q1_s)
        _tma_load(q2_desc, [qrow, qcol + D1], q_bar, q2_s)
        _load_k(k1_desc, k2_desc, k_ready.index(0), k1_s.index(0), k2_s.index(0), k0, c1, c2)
        _load_v(v_desc, v_ready.index(0), v_s.index(0), k0, cv)
        if n_tiles > 1:
            _load_k(k1_desc, k2_desc, k_ready.index(1), k1_s.index(1), k2_s.index(1), k0 + BLOCK_N, c1, c2)
            _load_v(v_desc, v_ready.index(1), v_s.index(1), k0 + BLOCK_N, cv)

        descs = (k1_desc, k2_desc, v_desc)
        smem = (q1_s, q2_s, k1_s, k2_s, v_s)
        bars = (q_bar, k_ready, k_empty, v_ready, v_empty)
        geo = (k0, c1, c2, cv)
        rows = (q0, qlen, klen, mb, h, n_tiles, n_full, scale_log2, stride_ot, stride_oh)
        gl.warp_specialize(
            [(_warpgroup, (descs, smem, bars, geo, O, rows, 0)), (_warpgroup, (descs, smem, bars, geo, O, rows, 1))],
            [4],
            [WORKER_REGS],
        )


@functools.cache
def _smem_layout(block: tuple[int, int]):
    """The shared-memory layout of a bf16 TMA block: a frozen value of the block's shape alone, built once (an eager
    prefill builds five descriptors a layer, and the layout was most of each one's host time)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def _desc(t: torch.Tensor, block: list[int]):
    """A 2-D TMA descriptor over [tokens, (H - 1) * head stride + D] of t [T, H, D] (or [T, D]): head h's columns
    start at h * t.stride(1)."""
    if t.dim() == 2:
        cols = t.shape[1]
    else:
        cols = (t.shape[1] - 1) * t.stride(1) + t.shape[2]
    return TensorDescriptor(t, [t.shape[0], cols], [t.stride(0), 1], block, _smem_layout(tuple(block)))


def supported(q, k_nope, k_rope, v, out) -> bool:
    """Whether this kernel takes these tensors: MLA's head dims, bf16, sm_90, and strides a TMA can address
    (16-byte aligned bases and token strides)."""
    if not (AVAILABLE and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    if (k_nope.shape[-1], k_rope.shape[-1], v.shape[-1]) != HEAD_DIMS or q.shape[-1] != 192:
        return False
    ts = (q, k_nope, k_rope, v)
    if any(t.dtype != torch.bfloat16 for t in (*ts, out)):
        return False
    for t in ts:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or t.stride(0) % 8 or (t.dim() == 3 and t.stride(1) % 8):
            return False
    return True


def prefill_attention_mla_gluon(q, k_nope, k_rope, v, cu_q, cu_k, scale, out, max_q_len, block_n=128):
    """prefill_attention_mla's contract for MLA's head dims (see `supported`): q [Tp, H, 192], k_nope [C, H, 128],
    k_rope [C, 64] or [C, H, 64], v [C, H, 128], cu_q/cu_k [B+1] int32 -> out [Tp, H, 128]. block_n: key rows a
    tile (128: Q 48 KB + two K/V slots of 80 KB of shared memory)."""
    Tp, H, _ = q.shape
    B = cu_q.shape[0] - 1
    if Tp == 0 or B == 0 or max_q_len == 0:
        return out
    num_mb = (max_q_len + BLOCK_M - 1) // BLOCK_M
    k2h = k_rope.stride(1) if k_rope.dim() == 3 else 0
    g = 4  # heads whose query blocks interleave (the Triton kernel's HEAD_GROUP), a divisor of H
    while H % g:
        g -= 1
    _prefill_attention_gluon_kernel[(B * H * num_mb,)](
        _desc(q, [BLOCK_M, 128]),
        _desc(q, [BLOCK_M, 64]),
        _desc(k_nope, [block_n, 128]),
        _desc(k_rope, [block_n, 64]),
        _desc(v, [block_n, 128]),
        out,
        cu_q,
        cu_k,
        scale * LOG2E,
        num_mb,
        q.stride(1),
        k_nope.stride(1),
        k2h,
        v.stride(1),
        out.stride(0),
        out.stride(1),
        H,
        g,
        WORKER_REGS=WORKER_REGS,
        num_warps=4,  # the first warpgroup's partition; the second's 4 warps are the worker
    )
    return out
