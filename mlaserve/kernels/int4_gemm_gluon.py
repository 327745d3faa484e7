"""The INT4 MoE's GEMM1 of small row blocks in Gluon (Hopper): each dequantized weight tile goes from the packed words
straight into wgmma's register A operand, with no pass through shared memory.

int4_gemm.py's Triton GEMM1 loads a thread's packed words in a blocked layout, while wgmma's A fragment (lane
(g, t) of warp w: rows 16 w + g and + 8, k-slots 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of every 16-wide k step) wants each
word's 8 nibbles on 4 lanes: so the compiler moves every dequantized tile through shared memory (a store, a
barrier, ldmatrix), which keeps the L1 / shared path busy. Here K is permuted inside each 128-wide block so that a
thread's own words are its fragment: thread t takes words 4 t .. 4 t + 3 of its two rows (one 16-byte load a row,
exactly scale group t), and nibble pair (j, j + 4) of word 4 t + m becomes k-slots (2 t, 2 t + 1) (j even) or
(2 t + 8, 2 t + 9) (j odd) of k step 2 m + j // 2. The dot sums over K, so x, the B operand, is permuted the same
way (x_perm: one gather a call); the weights keep the checkpoint's layout.

Dequantization is int4_gemm.DEQ_BF2_ASM's: (n - 8) * scale rounded once to bf16, as the reference rounds its
dequantized weights; the fp32 sums run in another order than the Triton kernel's, so outputs agree to rounding.
Contract: int4_gemm._int4_gemm1_kernel's for bf16 x, K (= D) a multiple of 128, 64 weight rows x BLOCK_M tokens a
program on one warpgroup.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .int4_gemm import DEQ_BF2_ASM, DEQ_BF2_CONSTRAINTS

try:  # Gluon's Hopper API as Triton 3.6 names it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

BLOCK_N = 64  # weight rows a program: wgmma's M on one warpgroup
BLOCK_K = 128  # the permutation's block: 16 words a row, 4 scale groups


@functools.cache
def k_perm(device=None) -> torch.Tensor:
    """[128] int64: x_perm[..., q] = x[..., k_perm[q]] inside each 128-wide block. q = 32 m + 16 jh + 8 jl + 2 t + e
    (k step 2 m + jh, k-slot 8 jl + 2 t + e) holds nibble j + 4 e of word 4 t + m, j = 2 jh + jl."""
    q = torch.arange(BLOCK_K)
    m, jh, jl, t, e = q // 32, (q // 16) % 2, (q // 8) % 2, (q // 2) % 4, q % 2
    return (8 * (4 * t + m) + 2 * jh + jl + 4 * e).to(device)


@triton.jit
def _permute_k_kernel(X, Out, stride_xt, stride_ot, NKB: tl.constexpr):
    """Program (token, 8 blocks of 128): Out[t, 128 b + q] = X[t, 128 b + k_perm[q]]."""
    q = tl.arange(0, 128)
    m, jh, jl, t, e = q // 32, (q // 16) % 2, (q // 8) % 2, (q // 2) % 4, q % 2
    src = 8 * (4 * t + m) + 2 * jh + jl + 4 * e
    row = tl.program_id(0).to(tl.int64)
    for b in tl.static_range(8):
        kb = tl.program_id(1) * 8 + b
        if kb < NKB:
            v = tl.load(X + row * stride_xt + 128 * kb + src)
            tl.store(Out + row * stride_ot + 128 * kb + q, v)


def permute_k(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] (K a multiple of 128) -> x_perm [T, K] contiguous, each 128-wide block permuted by k_perm."""
    T, K = x.shape
    if K % BLOCK_K or x.stride(1) != 1:
        raise ValueError(f"permute_k: x [T, K] with unit column stride and K a multiple of 128, got {tuple(x.shape)}")
    out = torch.empty(T, K, dtype=x.dtype, device=x.device)
    if T:
        _permute_k_kernel[(T, triton.cdiv(K // BLOCK_K, 8))](x, out, x.stride(0), out.stride(0), K // BLOCK_K)
    return out


if AVAILABLE:

    @gluon.jit
    def _int4_gemm1_rs_kernel(
        Xp,
        W13,
        S13,
        Hbuf,
        SortedIds,
        ExpertIds,
        NumPadded,
        I,
        D: gl.constexpr,
        num_m,
        TK,
        stride_xt,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_hm,
        TOPK: gl.constexpr,
        BLOCK_M: gl.constexpr,
        GROUP_M: gl.constexpr,
        PREFETCH: gl.constexpr,
    ):
        """Hbuf[m, n] = silu(x[tok] . gate[e, n]) * (x[tok] . up[e, n]) for the program's BLOCK_M rows m (one
        expert's block) and 64 gate rows n; Xp is x with K permuted (permute_k)."""
        ROWS: gl.constexpr = 64
        NK: gl.constexpr = D // 128
        # [64 rows, 4 groups t, 4 words m]: lane 4 g + t of warp w holds rows 16 w + g, + 8 and words 4 t .. + 3
        L3: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]],
            block_bases=[],
            shape=[ROWS, 4, 4],
        )
        L2: gl.constexpr = gl.SliceLayout(2, L3)  # [64, 4]: a row's scale groups
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        x_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        pid = gl.program_id(0)
        num_n = gl.cdiv(I, ROWS)
        group = pid // (GROUP_M * num_n)
        first_m = group * GROUP_M
        size = gl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * num_n)) % size
        pid_n = (pid % (GROUP_M * num_n)) // size
        if pid_m * BLOCK_M >= gl.load(NumPadded):  # past the padded total: sorted_ids there may be unwritten
            return
        e = gl.load(ExpertIds + pid_m).to(gl.int64)

        # x rows of the block (gathered tokens), [BLOCK_M, 128] a k step
        xr = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_l))
        ids = gl.load(SortedIds + xr)
        x_ok = (ids < TK)[:, None]
        xk = gl.arange(0, 128, layout=gl.SliceLayout(0, x_l))
        x_ptr = Xp + (ids // TOPK).to(gl.int64)[:, None] * stride_xt + xk[None, :]

        # weight words and scales, [64, 4, 4] / [64, 4] a k step
        r2 = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L2))
        t2 = gl.arange(0, 4, layout=gl.SliceLayout(0, L2))
        m3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        r_ok2 = r2 < I
        r3 = gl.expand_dims(gl.expand_dims(r2, 1), 2)
        t3 = gl.expand_dims(gl.expand_dims(t2, 0), 2)
        m3 = gl.expand_dims(gl.expand_dims(m3, 0), 1)
        r_ok3 = r3 < I
        g_ptr = W13 + e * stride_we + r3.to(gl.int64) * stride_wn + 4 * t3 + m3
        u_ptr = g_ptr + I * stride_wn
        gs_ptr = S13 + e * stride_se + r2.to(gl.int64)[:, None] * stride_sn + t2[None, :]
        us_ptr = gs_ptr + I * stride_sn

        x_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, 128], x_sl)
        acc_g = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=acc_l)
        acc_u = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=acc_l)
        xv = gl.load(x_ptr, mask=x_ok, other=0.0)
        wg = gl.load(g_ptr, mask=r_ok3, other=0)
        wu = gl.load(u_ptr, mask=r_ok3, other=0)
        sg = gl.load(gs_ptr, mask=r_ok2[:, None], other=0.0)
        su = gl.load(us_ptr, mask=r_ok2[:, None], other=0.0)
        for kb in range(NK):
            if not PREFETCH and kb > 0:
                xv = gl.load(x_ptr + kb * 128, mask=x_ok, other=0.0)
                wg = gl.load(g_ptr + kb * 16, mask=r_ok3, other=0)
                wu = gl.load(u_ptr + kb * 16, mask=r_ok3, other=0)
                sg = gl.load(gs_ptr + kb * 4, mask=r_ok2[:, None], other=0.0)
                su = gl.load(us_ptr + kb * 4, mask=r_ok2[:, None], other=0.0)
            slot = kb % 2
            x_s.index(slot).store(xv)
            fence_async_shared()
            a_g = _dequant_a(wg, sg, a_l)
            a_u = _dequant_a(wu, su, a_l)
            xt = x_s.index(slot).permute((1, 0))
            acc_g = warpgroup_mma(a_g, xt, acc_g, is_async=True)
            acc_u = warpgroup_mma(a_u, xt, acc_u, is_async=True)
            if PREFETCH:  # the next step's operands load while the MMAs run (the last step reloads its own)
                kn = gl.minimum(kb + 1, NK - 1)
                xv = gl.load(x_ptr + kn * 128, mask=x_ok, other=0.0)
                wg = gl.load(g_ptr + kn * 16, mask=r_ok3, other=0)
                wu = gl.load(u_ptr + kn * 16, mask=r_ok3, other=0)
                sg = gl.load(gs_ptr + kn * 4, mask=r_ok2[:, None], other=0.0)
                su = gl.load(us_ptr + kn * 4, mask=r_ok2[:, None], other=0.0)
            acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u, a_g, a_u, xt))[:2]
        h = (acc_g / (1.0 + gl.exp(-acc_g)) * acc_u).to(Hbuf.dtype.element_ty)  # silu(gate) * up
        n = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_l))
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_l))
        # padding rows too (zeros): GEMM2 reads them
        gl.store(Hbuf + rows.to(gl.int64)[None, :] * stride_hm + n[:, None], h, mask=(n < I)[:, None])

    @gluon.jit
    def _dequant_a(w, s, a_l: gl.constexpr):
        """Words w [64, 4, 4] int32 (L3) and their groups' bf16 scales s [64, 4] -> wgmma's A [64, 128] bf16 in a_l,
        K permuted as k_perm says."""
        bits = s.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        s2 = gl.expand_dims(bits | (bits << 16), 2)  # [64, 4, 1]: (s, s) a bf16 pair
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            DEQ_BF2_ASM, DEQ_BF2_CONSTRAINTS, [w, s2], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1
        )
        # [64, t, m, e, jl, jh] -> [64, m, jh, jl, t, e] -> q = 32 m + 16 jh + 8 jl + 2 t + e
        a = gl.join(gl.join(gl.join(o0, o4), gl.join(o1, o5)), gl.join(gl.join(o2, o6), gl.join(o3, o7)))
        a = gl.reshape(gl.permute(a, (0, 2, 5, 4, 1, 3)), (64, 128))
        return gl.convert_layout(a, a_l, assert_trivial=True)


GLUON_MAX_BLOCK_M = 64  # the row blocks measured faster than int4_gemm.py's GEMM1 (benchmarks/int4_gemm1_gluon.py)


def gemm1_gluon_takes(x, w13, s13, hbuf, c1: dict) -> bool:
    """Whether _int4_gemm1_rs_kernel takes this GEMM1: sm_90, bf16 x / scales / hbuf, K a multiple of 128, packed
    words and scales with unit inner stride, row blocks (c1's BLOCK_M) of 16 to GLUON_MAX_BLOCK_M rows."""
    if not (AVAILABLE and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9):
        return False
    if x.dtype != torch.bfloat16 or s13.dtype != torch.bfloat16 or hbuf.dtype != torch.bfloat16:
        return False
    bm = c1["BLOCK_M"]
    return (
        x.shape[1] % BLOCK_K == 0
        and x.stride(1) == 1
        and w13.stride(2) == 1
        and s13.stride(2) == 1
        and 16 <= bm <= GLUON_MAX_BLOCK_M
        and bm & (bm - 1) == 0
    )


def int4_gemm1_gluon(
    xp, w13, s13, hbuf, sorted_ids, expert_ids, num_padded, topk: int, block_m: int, group_m: int = 8, prefetch=True
):
    """_int4_gemm1_rs_kernel over moe_align's blocks of block_m rows: hbuf [padded rows, I] from xp (permute_k(x))."""
    T, D = xp.shape
    I = w13.shape[1] // 2
    num_m = expert_ids.shape[0]
    _int4_gemm1_rs_kernel[(num_m * -(-I // BLOCK_N),)](
        xp,
        w13,
        s13,
        hbuf,
        sorted_ids,
        expert_ids,
        num_padded,
        I,
        D,
        num_m,
        T * topk,
        xp.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        hbuf.stride(0),
        TOPK=topk,
        BLOCK_M=block_m,
        GROUP_M=group_m,
        PREFETCH=prefetch,
        num_warps=4,
    )
