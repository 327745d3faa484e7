"""The INT4 (W4A16) MoE of larger steps as grouped tiled GEMMs: the (token, k) pairs aligned per expert in blocks of
BLOCK_M rows (moe_align.py), each weight tile dequantized in registers to the activations' dtype, then tl.dot.

A [BLOCK_N, BLOCK_K] weight tile is [BLOCK_N, BLOCK_K/8] packed words plus [BLOCK_N, BLOCK_K/32] scales, each weight
dequantized to (n - 8) * scale rounded once to the dot's dtype, as the bf16 reference rounds its dequantized weights.
bf16 on the GPU: two weights at a time in bf16 pairs (DEQ_BF2_ASM). Else each word's nibbles are rotated pairwise
under the exponent of 1.0 (int4_gemv.py's trick: the bits read as 1 + n/16 or 1 + n/256), and one FMA per weight
gives (n - 8) * scale exactly in fp32 (f * 16s - 24s, f * 256s - 264s: every constant product is exact).

GEMM1: Hbuf[m, n] = silu(x[tok] . gate[e, n]) * (x[tok] . up[e, n]) for every padded row m of expert e's blocks.
GEMM2: Y[(t, k)] = topk_weight[t, k] * (Hbuf[m] . down[e]) for every real row m.

Each GEMM's K (GEMM1's D, GEMM2's I) is a constexpr: with a runtime K the loop has a zero-trip path that zeroes
the accumulator outside any wgmma, and ptxas then serializes every wgmma of the kernel (C7515: each waits for the
one before it), which a fixed trip count avoids (compile_check fails on that note).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_moe import _pid_to_tile
from .int4_gemv import ONE_BITS
from .pdl import pdl_start

# One word's 8 nibbles to bf16 (n - 8) * s, each rounded once (BF2): $8 the word, $9 the scale as a bf16 pair
# (s, s); out $0..$7 = nibbles 0..7. Pair j: (w >> 4j) & 0x000F000F | 0x43004300 is the bf16 pair (128 + n_j,
# 128 + n_{j+4}); minus 136 is exact, and the product with s rounds once, as the fp32 product rounded to bf16 does.
DEQ_BF2_ASM = tl.constexpr(
    "{ // int4_gemm:dequant\n.reg .b32 t, m, k, o, c, z, p<4>;\nmov.b32 m, 0x000F000F;\nmov.b32 k, 0x43004300;\n"
    "mov.b32 o, 0x3F803F80;\nmov.b32 c, 0xC308C308;\nmov.b32 z, 0x80008000;\n"
    + "".join(
        (f"shr.u32 t, $8, {4 * j};\nlop3.b32 p{j}, t, m, k, 0xEA;\n" if j else f"lop3.b32 p{j}, $8, m, k, 0xEA;\n")
        + f"fma.rn.bf16x2 p{j}, p{j}, o, c;\nfma.rn.bf16x2 p{j}, p{j}, $9, z;\nmov.b32 {{${j}, ${j + 4}}}, p{j};\n"
        for j in range(4)
    )
    + "}"
)
DEQ_BF2_CONSTRAINTS = tl.constexpr(",".join(["=h"] * 8 + ["r", "r"]))


@triton.jit
def _dequant_tile(
    w_ptr, s_ptr, n_ok, rem, one, KW: tl.constexpr, DTYPE: tl.constexpr, EVEN: tl.constexpr, BF2: tl.constexpr
):
    """Weight tile rows n (pointers w_ptr / s_ptr [N] to each row's words / scales at this K step), KW words (a
    multiple of 4) of which the row has `rem` left -> [N, 8 * KW] in DTYPE: (nibble - 8) * scale, rounded once.
    EVEN: 0 masks K; 1: every K step is whole (no K mask, so the words load 16 bytes at a time); 2: also bf16 scales
    read as 4-byte words of two groups (a thread's 2-byte scale load is not prefetched: cp.async needs 4 bytes).
    BF2 (bf16 x and scales, compiled kernels): two weights an instruction in bf16 pairs (DEQ_BF2_ASM), the same
    values."""
    N: tl.constexpr = w_ptr.shape[0]
    G: tl.constexpr = KW // 4
    kw = tl.arange(0, KW)
    if EVEN > 0:
        w = tl.load(w_ptr[:, None] + kw[None, :], mask=n_ok[:, None], other=0)  # [N, KW] int32
    else:
        w = tl.load(w_ptr[:, None] + kw[None, :], mask=n_ok[:, None] & (kw < rem)[None, :], other=0)
    if EVEN == 2:
        g2 = tl.arange(0, G // 2)
        s2_ptr = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        v = tl.load(s2_ptr[:, None] + g2[None, :], mask=n_ok[:, None], other=0).to(tl.uint32, bitcast=True)
        if BF2:  # each group's scale as a bf16 pair (s, s)
            pairs = tl.join((v & 0xFFFF) | (v << 16), (v >> 16) | (v & 0xFFFF0000))
            s2 = tl.reshape(pairs, (N, G)).to(tl.int32, bitcast=True)
        else:
            lo = (v << 16).to(tl.float32, bitcast=True)  # group 2j: bf16 bits to the top of an fp32, exact
            hi = (v & 0xFFFF0000).to(tl.float32, bitcast=True)
            s = tl.reshape(tl.join(lo, hi), (N, G))
    else:
        g = tl.arange(0, G)
        if EVEN > 0:
            s = tl.load(s_ptr[:, None] + g[None, :], mask=n_ok[:, None], other=0.0)
        else:
            s = tl.load(s_ptr[:, None] + g[None, :], mask=n_ok[:, None] & (4 * g < rem)[None, :], other=0.0)
        if BF2:
            bits = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            s2 = bits | (bits << 16)
    if BF2:
        out = _dequant_bf2(w, s2, N, KW)
    else:
        s = s.to(tl.float32)[:, :, None, None]  # [N, G, 1, 1]
        # nibble pair p rotated left by 15 - 8p: nibble 2p + 1 to bits 19-22 (reads 1 + n/16 under 1.0's
        # exponent), 2p to bits 15-18 (1 + n/256); one FMA each gives (n - 8) * s exactly (16 s, 24 s, 256 s, 264 s
        # are exact)
        rot = ((15 - 8 * tl.arange(0, 4)) & 31).to(tl.uint32)[None, None, None, :]
        u = tl.reshape(w, (N, G, 4, 1)).to(tl.uint32, bitcast=True)
        t = (u << rot) | (u >> ((32 - rot) & 31))  # [N, G, 4 words, 4 pairs]
        lo = ((t & 0x00078000) | one).to(tl.float32, bitcast=True) * (256.0 * s) - 264.0 * s
        hi = ((t & 0x00780000) | one).to(tl.float32, bitcast=True) * (16.0 * s) - 24.0 * s
        out = tl.reshape(tl.join(lo, hi), (N, 32 * G)).to(DTYPE)  # column 8 * word + nibble
    return out


@triton.jit
def _dequant_bf2(w, s2, N: tl.constexpr, KW: tl.constexpr):
    """Words w [N, KW] int32 and their groups' scales as bf16 pairs s2 [N, KW / 4] int32 -> [N, 8 KW] bf16."""
    G: tl.constexpr = KW // 4
    s2w = tl.reshape(tl.broadcast_to(s2[:, :, None], (N, G, 4)), (N, KW))
    o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
        DEQ_BF2_ASM, DEQ_BF2_CONSTRAINTS, [w, s2w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1
    )
    # tl.join stacks on a new last axis: join(q, p)[..., a, b, c] is nibble 4 a + 2 b + c (q: the even nibbles, p:
    # the odd), so the flattened order is the words' column order
    q = tl.join(tl.join(o0, o4), tl.join(o2, o6))
    p = tl.join(tl.join(o1, o5), tl.join(o3, o7))
    return tl.reshape(tl.join(q, p), (N, 8 * KW))


@triton.jit
def _dot(a, w, acc, TRANS: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc [M, N] += a [M, K] . w [N, K]^T; TRANS: acc [N, M] += w . a^T (w, dequantized in registers, as wgmma's A
    operand read from registers)."""
    if TRANS:
        acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PREC)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _block(pid_m, SortedIds, ExpertIds, BLOCK_M: tl.constexpr):
    """Block pid_m (below the padded total) -> (expert (int64), pair index of each row (TK: padding), rows m)."""
    e = tl.load(ExpertIds + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, tl.load(SortedIds + rows), rows


@triton.jit(do_not_specialize=["num_m", "TK"])
def _int4_gemm1_kernel(
    X,
    W13,
    S13,
    Hbuf,
    SortedIds,
    ExpertIds,
    NumPadded,
    I,
    D: tl.constexpr,
    num_m,
    TK,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_hm,
    one,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TRANS: tl.constexpr,
    EVEN: tl.constexpr,
    BF2: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(NumPadded):  # past the padded total: sorted_ids there may be unwritten
        return
    e, ids, rows = _block(pid_m, SortedIds, ExpertIds, BLOCK_M)
    row_ok = ids < TK
    tok = (ids // TOPK).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    KW: tl.constexpr = BLOCK_K // 8
    k = tl.arange(0, BLOCK_K)
    g_ptr = W13 + e * stride_we + n.to(tl.int64) * stride_wn
    u_ptr = g_ptr + I * stride_wn
    gs_ptr = S13 + e * stride_se + n.to(tl.int64) * stride_sn
    us_ptr = gs_ptr + I * stride_sn
    a_ptr = X + tok[:, None] * stride_xt + k[None, :]
    if TRANS:  # h^T [BLOCK_N, BLOCK_M] (_dot)
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN > 0:
            a = tl.load(a_ptr + k0, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptr + k0, mask=row_ok[:, None] & (k < D - k0)[None, :], other=0.0)
        g = _dequant_tile(
            g_ptr + k0 // 8, gs_ptr + k0 // 32, n_ok, (D - k0) // 8, one, KW, X.dtype.element_ty, EVEN, BF2
        )
        acc_g = _dot(a, g, acc_g, TRANS, DOT_PREC)
        u = _dequant_tile(
            u_ptr + k0 // 8, us_ptr + k0 // 32, n_ok, (D - k0) // 8, one, KW, X.dtype.element_ty, EVEN, BF2
        )
        acc_u = _dot(a, u, acc_u, TRANS, DOT_PREC)
    h = (acc_g * tl.sigmoid(acc_g) * acc_u).to(Hbuf.dtype.element_ty)
    # padding rows too (zeros): GEMM2 reads them
    if TRANS:
        tl.store(Hbuf + rows.to(tl.int64)[None, :] * stride_hm + n[:, None], h, mask=n_ok[:, None])
    else:
        tl.store(Hbuf + rows.to(tl.int64)[:, None] * stride_hm + n[None, :], h, mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_m", "TK"])
def _int4_gemm2_kernel(
    Hbuf,
    W2,
    S2,
    Y,
    TopkW,
    SortedIds,
    ExpertIds,
    NumPadded,
    D,
    I: tl.constexpr,
    num_m,
    TK,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_yt,
    one,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TRANS: tl.constexpr,
    EVEN: tl.constexpr,
    BF2: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), num_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(NumPadded):  # past the padded total: sorted_ids there may be unwritten
        return
    e, ids, rows = _block(pid_m, SortedIds, ExpertIds, BLOCK_M)
    row_ok = ids < TK
    d = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d_ok = d < D
    KW: tl.constexpr = BLOCK_K // 8
    k = tl.arange(0, BLOCK_K)
    w_ptr = W2 + e * stride_we + d.to(tl.int64) * stride_wn
    s_ptr = S2 + e * stride_se + d.to(tl.int64) * stride_sn
    a_ptr = Hbuf + rows.to(tl.int64)[:, None] * stride_hm + k[None, :]
    if TRANS:  # y^T [BLOCK_N, BLOCK_M] (GEMM1's TRANS)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN > 0:
            a = tl.load(a_ptr + k0)
        else:
            a = tl.load(a_ptr + k0, mask=(k < I - k0)[None, :], other=0.0)
        b = _dequant_tile(
            w_ptr + k0 // 8, s_ptr + k0 // 32, d_ok, (I - k0) // 8, one, KW, Hbuf.dtype.element_ty, EVEN, BF2
        )
        acc = _dot(a, b, acc, TRANS, DOT_PREC)
    tw = tl.load(TopkW + ids, mask=row_ok, other=0.0)
    if TRANS:
        y_ptr = Y + ids.to(tl.int64)[None, :] * stride_yt + d[:, None]
        tl.store(y_ptr, (acc * tw[None, :]).to(Y.dtype.element_ty), mask=row_ok[None, :] & d_ok[:, None])
    else:
        y_ptr = Y + ids.to(tl.int64)[:, None] * stride_yt + d[None, :]
        tl.store(y_ptr, (acc * tw[:, None]).to(Y.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _even(K: int, block_k: int, scale) -> int:
    """_dequant_tile's EVEN for a GEMM over K with scales `scale` [E, N, K/32]."""
    if K % block_k:
        return 0
    pairs = (
        scale.dtype == torch.bfloat16
        and (block_k // 32) % 2 == 0
        and scale.stride(0) % 2 == 0
        and scale.stride(1) % 2 == 0
        and scale.data_ptr() % 4 == 0
    )
    return 2 if pairs else 1


# CPU tensors take the bf16 pairs too: set by benchmarks/compile_check.py (which compiles CPU calls for sm_90) and
# by tests that run the PTX under the interpreter (tests/interp_mma.py); the interpreter alone runs no PTX
BF2_ON_CPU = False


def bf16_pairs(x: torch.Tensor, *scales: torch.Tensor) -> bool:
    """_dequant_tile's BF2: bf16 activations and scales on an sm_80+ GPU (or on CPU where BF2_ON_CPU says so)."""
    if x.dtype != torch.bfloat16 or any(s.dtype != torch.bfloat16 for s in scales):
        return False
    if not x.is_cuda:
        return BF2_ON_CPU
    return torch.cuda.get_device_capability(x.device)[0] >= 8


def int4_gemm(x, w13, s13, w2, s2, topk_weights, topk_ids, sorted_ids, expert_ids, num_padded, hbuf, y, pdl, c1, c2):
    """Both GEMMs over moe_align's blocks (BLOCK_M = c1["BLOCK_M"] = c2["BLOCK_M"]) into hbuf [padded rows, I] and
    y [TK, D]; the caller checked every shape. c1 / c2: {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps",
    "num_stages"}, optional "TRANS" (the transposed product, same sums)."""
    bf2 = bf16_pairs(x, s13, s2)
    int4_gemm1(x, w13, s13, topk_ids.shape[-1], sorted_ids, expert_ids, num_padded, hbuf, pdl, c1, bf2)
    int4_gemm2(hbuf, w2, s2, topk_weights, sorted_ids, expert_ids, num_padded, y, pdl, c2, bf2)


def int4_gemm1(x, w13, s13, K, sorted_ids, expert_ids, num_padded, hbuf, pdl, c1, bf2):
    """GEMM1 over moe_align's blocks: hbuf [padded rows, I] = silu(x . gate) * (x . up); K: the pairs a token."""
    T, D = x.shape
    I = w13.shape[1] // 2
    TK = T * K
    num_m = expert_ids.shape[0]
    common = dict(DOT_PREC="ieee" if x.dtype.itemsize == 4 else "tf32", BF2=bf2, **pdl)
    _int4_gemm1_kernel[(num_m * triton.cdiv(I, c1["BLOCK_N"]),)](
        x,
        w13,
        s13,
        hbuf,
        sorted_ids,
        expert_ids,
        num_padded,
        I,
        D,
        num_m,
        TK,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        hbuf.stride(0),
        ONE_BITS,
        TOPK=K,
        BLOCK_M=c1["BLOCK_M"],
        BLOCK_N=c1["BLOCK_N"],
        BLOCK_K=c1["BLOCK_K"],
        GROUP_M=c1["GROUP_M"],
        TRANS=c1.get("TRANS", False),
        EVEN=_even(D, c1["BLOCK_K"], s13),
        num_warps=c1["num_warps"],
        num_stages=c1["num_stages"],
        **common,
    )


def int4_gemm2(hbuf, w2, s2, topk_weights, sorted_ids, expert_ids, num_padded, y, pdl, c2, bf2):
    """GEMM2 over moe_align's blocks: y [TK, D] = topk_weight * (hbuf . down) for every real row."""
    I, D = hbuf.shape[1], w2.shape[1]
    TK = y.shape[0]
    num_m = expert_ids.shape[0]
    common = dict(DOT_PREC="ieee" if hbuf.dtype.itemsize == 4 else "tf32", BF2=bf2, **pdl)
    _int4_gemm2_kernel[(num_m * triton.cdiv(D, c2["BLOCK_N"]),)](
        hbuf,
        w2,
        s2,
        y,
        topk_weights.reshape(-1),
        sorted_ids,
        expert_ids,
        num_padded,
        D,
        I,
        num_m,
        TK,
        hbuf.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        y.stride(0),
        ONE_BITS,
        BLOCK_M=c2["BLOCK_M"],
        BLOCK_N=c2["BLOCK_N"],
        BLOCK_K=c2["BLOCK_K"],
        GROUP_M=c2["GROUP_M"],
        TRANS=c2.get("TRANS", False),
        EVEN=_even(I, c2["BLOCK_K"], s2),
        num_warps=c2["num_warps"],
        num_stages=c2["num_stages"],
        **common,
    )
