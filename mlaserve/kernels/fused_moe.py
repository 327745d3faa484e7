"""Fused MoE experts: align (token, k) pairs into per-expert blocks, grouped GEMM1 with SiLU(gate)*up fused,
grouped GEMM2 with the top-k weight fused, then the sum over k (moe_sum.py; optionally with the add + RMSNorm that
follows the MoE block fused in). No host sync; buffers sized from shapes only.

Align (moe_align.py) lays the owned pairs out per expert in padded blocks of BLOCK_M rows (sentinel T*K in the
padding) and writes each block's expert; every row's output is independent of the others in its block.

Shared-experts fusion (`shared=`): the shared MLP's rank-local intermediate (S * I channels) is split into S slots of
I channels, local experts E .. E+S-1, which the routing selects for every token with weight 1.0. The GEMMs read a
slot's weights in place from the shared MLP's own tensors (other strides than the routed experts' [E, 2I, D] /
[E, D, I], so a block picks its base pointers by expert id): no copy of the shared weights exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..kernel_config import KernelConfig
from .moe_align import moe_align
from .moe_config import moe_config
from .moe_gemv import moe_gemv
from .moe_sum import moe_sum
from .pdl import pdl_args, pdl_release, pdl_start, pdl_wait


@triton.jit
def _pid_to_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks share each weight tile while it is in L2."""
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size
    pid_n = (pid % (GROUP_M * num_n)) // size
    return pid_m, pid_n


@triton.jit
def _block_rows(pid_m, SortedIds, ExpertIds, TopkIds, expert_offset, TK, BLOCK_M: tl.constexpr, NO_ALIGN: tl.constexpr):
    """-> (expert, pair index of each row (TK: padding), Hbuf row of each row, whether GEMM1 stores the row).
    NO_ALIGN: block pid_m is pair pid_m alone (row 0; the other rows alias its Hbuf row and are never stored).
    Loads through L2 (.cg): GEMM2 makes them before its PDL wait (_moe_gemm2_kernel)."""
    offs = tl.arange(0, BLOCK_M)
    if NO_ALIGN:
        e = tl.load(TopkIds + pid_m, cache_modifier=".cg") - expert_offset
        ids = tl.where(offs == 0, pid_m, TK)
        rows = pid_m + tl.zeros([BLOCK_M], tl.int32)
        store = offs == 0
    else:
        e = tl.load(ExpertIds + pid_m, cache_modifier=".cg")
        rows = pid_m * BLOCK_M + offs
        ids = tl.load(SortedIds + rows, cache_modifier=".cg")
        store = offs >= 0  # padding rows too (zeros): GEMM2 reads them
    return e.to(tl.int64), ids, rows, store


@triton.jit
def _skip_block(pid_m, NumPadded, TopkIds, expert_offset, E_LOCAL, BLOCK_M: tl.constexpr, NO_ALIGN: tl.constexpr):
    """Past the padded total; NO_ALIGN: the pair's expert is not owned by this rank."""
    if NO_ALIGN:
        e = tl.load(TopkIds + pid_m, cache_modifier=".cg") - expert_offset
        skip = (e < 0) | (e >= E_LOCAL)
    else:
        skip = pid_m * BLOCK_M >= tl.load(NumPadded, cache_modifier=".cg")
    return skip


@triton.jit
def _gemm1_tma(a_ptr, row_ok, DG, DU, rg, ru, acc_g, acc_u, D, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """GEMM1's K loop over TMA weight tiles: gate rows rg.., up rows ru.. (D % BLOCK_K == 0)."""
    for k0 in range(0, D, BLOCK_K):
        a = tl.load(a_ptr + k0, mask=row_ok[:, None], other=0.0)
        g = DG.load([rg, k0])  # [N, K]
        u = DU.load([ru, k0])
        acc_g = tl.dot(a, tl.trans(g), acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, tl.trans(u), acc_u, input_precision=DOT_PREC)
    return acc_g, acc_u


@triton.jit
def _gemm1_ptr(
    a_ptr,
    row_ok,
    g_ptr,
    u_ptr,
    n_ok,
    offs_k,
    acc_g,
    acc_u,
    D,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """GEMM1's K loop over masked pointer loads: gate and up tiles as [K, N] views."""
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
    return acc_g, acc_u


@triton.jit
def _gemm2_tma(
    a_ptr, DW, r0, c0, acc, I, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, PREWAIT: tl.constexpr, PDL: tl.constexpr
):
    """GEMM2's K loop over TMA weight tiles: rows r0.., columns c0 + k (I % BLOCK_K == 0). PREWAIT: the kernel has
    not waited yet; the first tile (a weight) is fetched before the PDL wait and Hbuf (GEMM1's output) read after
    it. The sums run in the same order either way."""
    k_first = 0
    if PREWAIT:
        b = DW.load([r0, c0])  # [N, K]
        pdl_wait(PDL)
        acc = tl.dot(tl.load(a_ptr), tl.trans(b), acc, input_precision=DOT_PREC)
        k_first = BLOCK_K
    for k0 in range(k_first, I, BLOCK_K):
        a = tl.load(a_ptr + k0)
        b = DW.load([r0, c0 + k0])  # [N, K]
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _gemm2_ptr(a_ptr, b_ptr, n_ok, offs_k, acc, I, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """GEMM2's K loop over masked pointer loads: the down tile as a [K, N] view."""
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
    return acc


@triton.jit(do_not_specialize=["num_m", "TK", "expert_offset"])
def _moe_gemm1_kernel(
    X,
    W13,
    Hbuf,
    SortedIds,
    ExpertIds,
    NumPadded,
    TopkIds,
    W1S,
    W3S,
    G13,
    G1S,
    G3S,
    I,
    D,
    num_m,
    stride_xt,
    stride_we,
    stride_wn,
    stride_hm,
    TK,
    expert_offset,
    E_LOCAL,
    E_ROUTED,
    stride_sn,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    NO_ALIGN: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    TMA: tl.constexpr,
    PREWAIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Hbuf[m, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for the padded row m of expert e.
    HAS_SHARED: experts e >= E_ROUTED are shared slots j = e - E_ROUTED: rows [j*I, (j+1)*I) of W1S (gate), W3S (up).
    TMA: whole [BLOCK_N, BLOCK_K] weight tiles by TMA (G13: w13 as [E * 2I, D] rows; G1S / G3S: the slots').
    PREWAIT: wait, then release, so GEMM2's programs launch only once the routing is complete (_moe_gemm2_kernel)."""
    if PREWAIT:
        pdl_wait(PDL)
        pdl_release(PDL)
    else:
        pdl_start(PDL)
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if _skip_block(pid_m, NumPadded, TopkIds, expert_offset, E_LOCAL, BLOCK_M, NO_ALIGN):
        return
    e, ids, offs_m, store = _block_rows(pid_m, SortedIds, ExpertIds, TopkIds, expert_offset, TK, BLOCK_M, NO_ALIGN)
    row_ok = ids < TK
    tok = (ids // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = X + tok[:, None] * stride_xt + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if TMA:
        # The routed call appears twice: without shared experts G1S / G3S are None, so the slot branch must not
        # exist at all (a constexpr HAS_SHARED), and a descriptor cannot be chosen at run time (it would leave the
        # kernel's parameter space).
        n0 = pid_n * BLOCK_N
        if HAS_SHARED:
            if e >= E_ROUTED:
                rs = ((e - E_ROUTED) * I + n0).to(tl.int32)
                acc_g, acc_u = _gemm1_tma(a_ptr, row_ok, G1S, G3S, rs, rs, acc_g, acc_u, D, BLOCK_K, DOT_PREC)
            else:
                rg = (e * 2 * I + n0).to(tl.int32)
                acc_g, acc_u = _gemm1_tma(a_ptr, row_ok, G13, G13, rg, rg + I, acc_g, acc_u, D, BLOCK_K, DOT_PREC)
        else:
            rg = (e * 2 * I + n0).to(tl.int32)
            acc_g, acc_u = _gemm1_tma(a_ptr, row_ok, G13, G13, rg, rg + I, acc_g, acc_u, D, BLOCK_K, DOT_PREC)
    else:
        g_ptr = W13 + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K, N] view
        u_ptr = g_ptr + I * stride_wn
        if HAS_SHARED:
            if e >= E_ROUTED:
                rows_s = ((e - E_ROUTED) * I + offs_n[None, :]) * stride_sn  # int64 (e is)
                g_ptr = W1S + rows_s + offs_k[:, None]
                u_ptr = W3S + rows_s + offs_k[:, None]
        acc_g, acc_u = _gemm1_ptr(a_ptr, row_ok, g_ptr, u_ptr, n_ok, offs_k, acc_g, acc_u, D, BLOCK_K, EVEN_K, DOT_PREC)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    h_ptr = Hbuf + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptr, h.to(Hbuf.dtype.element_ty), mask=store[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_m", "TK", "expert_offset"])
def _moe_gemm2_kernel(
    Hbuf,
    W2,
    Y,
    SortedIds,
    ExpertIds,
    NumPadded,
    TopkW,
    TopkIds,
    W2S,
    G2,
    G2S,
    D,
    I,
    num_m,
    stride_hm,
    stride_we,
    stride_wn,
    stride_yt,
    TK,
    expert_offset,
    E_LOCAL,
    E_ROUTED,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    NO_ALIGN: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    TMA: tl.constexpr,
    PREWAIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Y[(t, k)] = topk_weight[t, k] * (Hbuf[m] . w2[e])  for every real row m of expert e's blocks.
    HAS_SHARED: experts e >= E_ROUTED are shared slots j = e - E_ROUTED, columns [j*I, (j+1)*I) of W2S (down).
    TMA: whole [BLOCK_N, BLOCK_K] weight tiles by TMA (G2: w2 as [E * D, I] rows; G2S: the slots' [D, S * I]).
    PREWAIT: the block's rows and expert (routing / align outputs), and with TMA its first weight tile, are read
    before the PDL wait. That is safe because GEMM1 releases this kernel only after its own wait, so the routing
    was complete when these programs launched; they read it through L2 (.cg). It overlaps this kernel's first
    weight round trip with GEMM1's tail (pdl.py)."""
    pdl_release(PDL)
    if not PREWAIT:
        pdl_wait(PDL)
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), num_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    if _skip_block(pid_m, NumPadded, TopkIds, expert_offset, E_LOCAL, BLOCK_M, NO_ALIGN):
        return
    e, ids, offs_m, _ = _block_rows(pid_m, SortedIds, ExpertIds, TopkIds, expert_offset, TK, BLOCK_M, NO_ALIGN)
    row_ok = ids < TK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = Hbuf + offs_m.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if TMA:  # the routed call twice, as in GEMM1
        n0 = pid_n * BLOCK_N
        if HAS_SHARED:
            if e >= E_ROUTED:
                acc = _gemm2_tma(
                    a_ptr, G2S, n0, ((e - E_ROUTED) * I).to(tl.int32), acc, I, BLOCK_K, DOT_PREC, PREWAIT, PDL
                )
            else:
                acc = _gemm2_tma(a_ptr, G2, (e * D + n0).to(tl.int32), 0, acc, I, BLOCK_K, DOT_PREC, PREWAIT, PDL)
        else:
            acc = _gemm2_tma(a_ptr, G2, (e * D + n0).to(tl.int32), 0, acc, I, BLOCK_K, DOT_PREC, PREWAIT, PDL)
    else:
        if PREWAIT:  # the pointer loads fetch no tile early
            pdl_wait(PDL)
        b_ptr = W2 + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K, N] view
        if HAS_SHARED:
            if e >= E_ROUTED:
                b_ptr = W2S + (e - E_ROUTED) * I + offs_n[None, :].to(tl.int64) * stride_sn + offs_k[:, None]
        acc = _gemm2_ptr(a_ptr, b_ptr, n_ok, offs_k, acc, I, BLOCK_K, EVEN_K, DOT_PREC)
    w = tl.load(TopkW + ids, mask=row_ok, other=0.0)
    acc = acc * w[:, None]
    y_ptr = Y + ids.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _tma_default(x: torch.Tensor, bm: int, on: bool) -> bool:
    """TMA weight tiles for the decode (BLOCK_M 16) GEMMs in bf16/fp16 on sm_90+, when on (KernelConfig.moe_tma).
    The weight streaming is the whole cost there: M1 batch 1 TPOT 2.12 -> 2.02 ms on an H200 (moe_config.py)."""
    return (
        on
        and bm == 16
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def _gemv_default(x: torch.Tensor, no_align: bool, kernels: KernelConfig) -> bool | dict:
    """The GEMV form (moe_gemv.py) for per-pair blocks (1-2 token steps) of 16-bit steps on the GPU, as
    KernelConfig.moe_gemv_config says (MLASERVE_MOE_GEMV=0 turns it off; docs/experiments.md has its A/B)."""
    if not (no_align and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    return kernels.moe_gemv_config()


def experts_form(x: torch.Tensor, K: int, config: dict, kernels: KernelConfig) -> tuple[bool, bool | dict]:
    """-> (no_align, gemv) of fused_experts for x [T, D] at top-K, popping config's "no_align" and "gemv": per-pair
    blocks up to kernels.no_align_max_pairs pairs, the GEMV form (or its tiles) as _gemv_default says."""
    no_align = bool(config.pop("no_align", x.shape[0] * K <= kernels.no_align_max_pairs))
    gemv = config.pop("gemv", None)  # True/False, or moe_gemv's {"gemv1": {...}, "gemv2": {...}} overrides
    return no_align, _gemv_default(x, no_align, kernels) if gemv is None else gemv


def _tma_fits(w13, w2, shared, c1: dict, c2: dict, D: int, I: int) -> bool:
    """Whole tiles never straddle two experts (or slots), and every weight is row-contiguous and 16-byte aligned."""
    ws = [w13, w2] + list(shared or [])
    return (
        D % c1["BLOCK_K"] == 0
        and I % c1["BLOCK_N"] == 0
        and D % c2["BLOCK_N"] == 0
        and I % c2["BLOCK_K"] == 0
        and w13.is_contiguous()
        and w2.is_contiguous()
        and all(w.stride(-1) == 1 and (w.stride(0) * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0 for w in ws)
    )


def _check_shared(shared, I: int, D: int, dtype) -> int:
    """shared = (gate [S*I, D], up [S*I, D], down [D, S*I]), the shared MLP's rank-local weights -> S."""
    w1, w3, w2 = shared
    S = w1.shape[0] // I
    if S < 1 or w1.shape != (S * I, D) or w3.shape != (S * I, D) or w2.shape != (D, S * I):
        raise ValueError(
            f"shared gate/up/down {tuple(w1.shape)} {tuple(w3.shape)} {tuple(w2.shape)} must be "
            f"[S*{I}, {D}] [S*{I}, {D}] [{D}, S*{I}] (S >= 1 slots of the routed experts' I={I})"
        )
    if any(w.dtype != dtype or w.stride(-1) != 1 for w in shared) or w1.stride(0) != w3.stride(0):
        raise ValueError(f"shared weights must be {dtype} with a unit last stride, gate and up with one row stride")
    return S


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    config: dict | None = None,
    add: torch.Tensor | None = None,
    shared: tuple | None = None,
    norm: tuple | None = None,
    all_local: bool = False,
    kernels: KernelConfig = KernelConfig(),
):
    """sum_k w[t,k] * down(silu(gate(x)) * up(x)) over experts [offset, offset + E_local); equals
    layers.moe.fused_experts_ref. x [T, D]; w13 [E_local, 2I, D]; w2 [E_local, D, I]; topk_weights [T, K] fp32;
    topk_ids [T, K] int -> [T, D] in x.dtype, plus `add` [T, D] when given (fused into the sum).
    shared = (gate [S*I, D], up [S*I, D], down [D, S*I]): S more local experts E_local .. E_local+S-1 (ids
    offset + E_local + s), slot s being channels [s*I, (s+1)*I) of that MLP, read in place; their ids must be
    topk_ids' last S columns, in order (as routing.py writes them), since moe_align places them without counting.
    norm = (weight [D], eps, residual [T, D]): the add + RMSNorm that follows the MoE, fused into its sum over k
    (moe_sum.py) -> (norm(out + residual), out + residual), bit-equal to add_rms_norm(out, residual, weight, eps).
    config (benchmarks, tests): moe_config overrides, flat or {"gemm1": {...}, "gemm2": {...}}, plus "decode_tiles"
    (deterministic mode: on the GPU in 16-bit, steps whose default tiles have 16-row blocks take those instead of
    the overrides, the same bits), "no_align": bool (default: T*K <= kernels.no_align_max_pairs) and "tma": bool
    (weight tiles by TMA; default: kernels.moe_tma, for the bf16/fp16 decode tiles, BLOCK_M 16, on sm_90+ where
    whole tiles fit), "prewait": bool (GEMM2's reads before its PDL wait; default: kernels.moe_prewait under PDL
    with no_align; tests set it without PDL, where it only reorders the code), and "gemv": bool or moe_gemv's
    {"gemv1": {...}, "gemv2": {...}} tiles (the GEMVs of moe_gemv.py instead of the tiled GEMMs, no_align steps
    only; default: kernels.moe_gemv_config()). all_local: every id names a local expert (no expert parallelism), so
    the sum over k reads no ids (moe_sum). kernels: the switches and thresholds above, and pdl (kernel_config.py)."""
    T, D = x.shape
    E, I2, D1 = w13.shape
    I = I2 // 2
    K = topk_ids.shape[-1]
    if D1 != D or w2.shape != (E, D, I) or I2 != 2 * I:
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} must be [E, 2I, {D}] / [E, {D}, I]")
    if topk_ids.shape != (T, K) or topk_weights.shape != (T, K) or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"topk_ids/topk_weights must be [{T}, K] (weights fp32), got {tuple(topk_ids.shape)} "
            f"{tuple(topk_weights.shape)} {topk_weights.dtype}"
        )
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(f"x {x.dtype}, w13 {w13.dtype} and w2 {w2.dtype} must share a dtype")
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("x, w13 and w2 need a unit stride in their last dim")
    S = 0 if shared is None else _check_shared(shared, I, D, x.dtype)
    w1s, w3s, w2s = shared if S else (w13, w13, w2)  # unused without shared experts (any pointer will do)
    E_all = E + S  # the routed experts, then the shared slots
    if T == 0:
        # checks `add`/`norm`; empty
        return moe_sum(x.new_empty(0, D), topk_ids, expert_offset, E_all, add, norm, all_local, kernels.pdl)
    TK = T * K
    config = dict(config or {})
    no_align, gemv = experts_form(x, K, config, kernels)  # pops config's no_align and gemv
    tma = config.pop("tma", None)
    prewait = config.pop("prewait", None)
    if config.pop("decode_tiles", False) and x.is_cuda and x.dtype != torch.float32:
        if moe_config(T, K, E_all, D, I, x.dtype)[0]["BLOCK_M"] == 16:
            # deterministic mode at decode sizes: the default 16-row tiles (BLOCK_K 128, TMA where it fits). A row's
            # sums are its k16 MMA steps chained in K order into one fp32 accumulator whatever the tile's rows,
            # columns and BLOCK_K, and wgmma and mma.sync agree: the fixed tiles' bits (test_deterministic_gpu.py)
            config, tma = {}, None
    if gemv:
        if not no_align:
            raise ValueError(f"gemv: the GEMV form serves per-pair blocks only (no_align; T*K={TK})")
        hbuf = torch.empty(TK, I, dtype=x.dtype, device=x.device)
        y = torch.empty(TK, D, dtype=x.dtype, device=x.device)
        moe_gemv(
            x,
            w13,
            w2,
            topk_weights,
            topk_ids,
            expert_offset,
            w1s,
            w3s,
            w2s,
            S,
            hbuf,
            y,
            pdl_args(x, kernels.pdl),
            gemv if isinstance(gemv, dict) else None,
        )
        return moe_sum(y, topk_ids, expert_offset, E_all, add, norm, all_local, kernels.pdl)
    c1, c2 = moe_config(T, K, E_all, D, I, x.dtype, **config)
    if tma is None:  # the default: the sm_90 decode tiles, where whole tiles fit (else the pointer loads)
        tma = _tma_default(x, c1["BLOCK_M"], kernels.moe_tma) and _tma_fits(
            w13, w2, shared if S else None, c1, c2, D, I
        )
    elif tma and not _tma_fits(w13, w2, shared if S else None, c1, c2, D, I):
        raise ValueError(
            f"tma: the weights' shapes (D={D}, I={I}) must be multiples of the tiles "
            f"(gemm1 {c1['BLOCK_N']}x{c1['BLOCK_K']}, gemm2 {c2['BLOCK_N']}x{c2['BLOCK_K']}) and the "
            "weights row-contiguous and 16-byte aligned"
        )
    if tma:  # the same tiles, fewer stages
        c1, c2 = moe_config(T, K, E_all, D, I, x.dtype, tma=True, **config)
    bm = c1["BLOCK_M"]
    ids = topk_ids.reshape(-1)
    if no_align:  # block m = pair m alone; the align buffers are unused (any pointer will do)
        sorted_ids = expert_ids = num_padded = ids
        rows, num_m = TK, TK
    else:
        # the shared slots (topk_ids' last S columns, the router's) are placed by arithmetic, not counted
        sorted_ids, expert_ids, num_padded = moe_align(topk_ids, E_all, expert_offset, bm, shared=S, pdl=kernels.pdl)
        rows, num_m = sorted_ids.shape[0], expert_ids.shape[0]
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    hbuf = torch.empty(rows, I, dtype=x.dtype, device=x.device)
    pdl = pdl_args(x, kernels.pdl)  # the two GEMMs launch alike
    if prewait is None:
        # GEMM2's reads before its wait: under PDL, for the per-pair blocks of decode steps of 1-2 tokens only (on
        # aligned blocks it lost: docs/experiments.md). MLASERVE_MOE_PREWAIT=0: off.
        prewait = pdl["PDL"] and no_align and kernels.moe_prewait
    g13 = g1s = g3s = g2 = g2s = None  # None arguments are constexpr: the pointer kernels have no descriptors
    if tma:
        b1, b2 = [c1["BLOCK_N"], c1["BLOCK_K"]], [c2["BLOCK_N"], c2["BLOCK_K"]]
        g13, g2 = TensorDescriptor.from_tensor(w13.view(-1, D), b1), TensorDescriptor.from_tensor(w2.view(-1, I), b2)
        if S:
            g1s, g3s = TensorDescriptor.from_tensor(w1s, b1), TensorDescriptor.from_tensor(w3s, b1)
            g2s = TensorDescriptor.from_tensor(w2s, b2)
    _moe_gemm1_kernel[(num_m * triton.cdiv(I, c1["BLOCK_N"]),)](
        x,
        w13,
        hbuf,
        sorted_ids,
        expert_ids,
        num_padded,
        ids,
        w1s,
        w3s,
        g13,
        g1s,
        g3s,
        I,
        D,
        num_m,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        hbuf.stride(0),
        TK,
        expert_offset,
        E_all,
        E,
        w1s.stride(0),
        TOPK=K,
        BLOCK_M=bm,
        BLOCK_N=c1["BLOCK_N"],
        BLOCK_K=c1["BLOCK_K"],
        GROUP_M=c1["GROUP_M"],
        EVEN_K=D % c1["BLOCK_K"] == 0,
        DOT_PREC=prec,
        NO_ALIGN=no_align,
        HAS_SHARED=S > 0,
        TMA=g13 is not None,
        PREWAIT=prewait,
        num_warps=c1["num_warps"],
        num_stages=c1["num_stages"],
        **pdl,
    )
    y = torch.empty(TK, D, dtype=x.dtype, device=x.device)
    _moe_gemm2_kernel[(num_m * triton.cdiv(D, c2["BLOCK_N"]),)](
        hbuf,
        w2,
        y,
        sorted_ids,
        expert_ids,
        num_padded,
        topk_weights.reshape(-1),
        ids,
        w2s,
        g2,
        g2s,
        D,
        I,
        num_m,
        hbuf.stride(0),
        w2.stride(0),
        w2.stride(1),
        y.stride(0),
        TK,
        expert_offset,
        E_all,
        E,
        w2s.stride(0) if S else w2.stride(1),
        BLOCK_M=bm,
        BLOCK_N=c2["BLOCK_N"],
        BLOCK_K=c2["BLOCK_K"],
        GROUP_M=c2["GROUP_M"],
        EVEN_K=I % c2["BLOCK_K"] == 0,
        DOT_PREC=prec,
        NO_ALIGN=no_align,
        HAS_SHARED=S > 0,
        TMA=g2 is not None,
        PREWAIT=prewait,
        num_warps=c2["num_warps"],
        num_stages=c2["num_stages"],
        **pdl,
    )
    return moe_sum(y, topk_ids, expert_offset, E_all, add, norm, all_local, kernels.pdl)
