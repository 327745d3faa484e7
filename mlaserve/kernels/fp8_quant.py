"""Per-token, per-128-channel FP8 quantization of activations (DeepSeek-V3's recipe): s = amax / 448, q = e4m3(x / s).

The scales come out column-major ([M, G] with strides (1, M_pad)): the layout torch.nn.functional.scaled_mm's
BlockWise1x128 operand wants, and in which one program's BLOCK_M scales are one contiguous store. The W8A8 GEMMs
(fp8_gemm.py, fp8_moe.py) read them through their strides. Divisions round to nearest (div_rn), as torch's do, so
q and s equal fp8_reference.fp8_act_quant_ref's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_reference import AMAX_FLOOR, FP8_MAX
from .pdl import pdl_args, pdl_start

_FLOOR = tl.constexpr(AMAX_FLOOR)
_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def quant_group(v):
    """v [R, G] fp32 (one group per row; masked entries 0) -> (q e4m3 [R, G], s fp32 [R])."""
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(v), 1), _FLOOR), _MAX)
    q = tl.clamp(tl.div_rn(v, s[:, None]), -_MAX, _MAX).to(tl.float8e4nv)
    return q, s


@triton.jit(do_not_specialize=["M", "MP"])
def _act_quant_kernel(
    X,
    Q,
    S,
    M,
    MP,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sg,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row block, group g): Q[rows, g*GROUP ..] and S[g, rows] for rows < MP; rows in [M, MP) (the row
    padding) get q = 0."""
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    k = g * GROUP + tl.arange(0, GROUP)
    ok = (rows < M)[:, None] & (k < K)[None, :]
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + k[None, :] * stride_xk, mask=ok, other=0.0)
    q, s = quant_group(x.to(tl.float32))
    tl.store(Q + rows.to(tl.int64)[:, None] * stride_qm + k[None, :], q, mask=(rows < MP)[:, None] & (k < K)[None, :])
    tl.store(S + g * stride_sg + rows, s, mask=rows < MP)


@triton.jit(do_not_specialize=["M", "P"])
def _gather_rows_kernel(
    QX,
    SX,
    Q,
    S,
    SortedIds,
    NumPadded,
    M,
    P,
    K,
    G,
    stride_qx,
    stride_sxg,
    stride_q,
    stride_sg,
    TOPK,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row block, BLOCK_K columns): row m of Q, S is QX's, SX's row SortedIds[m] // TOPK (a (token, k)
    pair in moe_align's order); a padding id (>= M * TOPK) gets quant_group's result for a zero row (q = 0,
    s = floor / max). Rows from NumPadded on are not written."""
    pdl_start(PDL)
    n_pad = tl.minimum(tl.load(NumPadded), P)
    if tl.program_id(0) * BLOCK_M >= n_pad:
        return
    # rows from num_padded on: moe_align may leave their ids unwritten (any value), so they are neither read
    # nor written (a program's rows can straddle num_padded: its blocks may be narrower than BLOCK_M)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < n_pad
    ids = tl.load(SortedIds + rows, mask=live, other=M * TOPK)
    real = ids < M * TOPK
    src = (ids // TOPK).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    q = tl.load(QX + src[:, None] * stride_qx + k[None, :], mask=real[:, None] & (k < K)[None, :], other=0.0)
    tl.store(Q + rows.to(tl.int64)[:, None] * stride_q + k[None, :], q, mask=live[:, None] & (k < K)[None, :])
    g = tl.program_id(1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
    s = tl.load(SX + g[None, :] * stride_sxg + src[:, None], mask=real[:, None] & (g < G)[None, :], other=0.0)
    s = tl.where(real[:, None], s, tl.div_rn(tl.full(s.shape, _FLOOR, tl.float32), _MAX))
    tl.store(S + g[None, :] * stride_sg + rows[:, None], s, mask=live[:, None] & (g < G)[None, :])


def act_quant(
    x: torch.Tensor, group: int = 128, row_align: int = 1, pdl: bool = True, sorted_pairs: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any strides) -> (q e4m3 [Mp, K] contiguous, s fp32 [Mp, ceil(K/group)] with strides (1, Mp)),
    Mp = M rounded up to row_align (the padding rows: q = 0). pdl: KernelConfig.pdl.
    sorted_pairs = (sorted_ids [P], num_padded [1], topk): the rows in moe_align's order instead, Mp = P: row m
    quantizes x[sorted_ids[m] // topk], 0 for a padding id (>= M * topk); rows from num_padded on are left unset
    (no GEMM reads them). Each token is quantized once, then its fp8 row copied to its topk places (gather_rows):
    the same bits as quantizing every copy, reading x once instead of topk times."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a 2-D floating tensor [M, K], got {tuple(x.shape)} {x.dtype}")
    if sorted_pairs is not None:
        return gather_rows(*act_quant(x, group, pdl=pdl), *sorted_pairs, x.shape[0], group, pdl)
    M, K = x.shape
    q, s_buf, launch = quant_outputs(M, K, group, row_align, x.device)
    Mp, G, block_m = q.shape[0], s_buf.shape[0], launch["BLOCK_M"]
    if Mp and K:
        _act_quant_kernel[(triton.cdiv(Mp, block_m), G)](
            x,
            q,
            s_buf,
            M,
            Mp,
            K,
            x.stride(0),
            x.stride(1),
            q.stride(0),
            s_buf.stride(0),
            **launch,
            **pdl_args(x, pdl),
        )
    return q, s_buf.t()


def quant_outputs(M: int, K: int, group: int, row_align: int, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The outputs of a per-row quantization of [M, K] in groups of `group` (act_quant, silu_mul_quant): q e4m3
    [Mp, K] and the scales' buffer fp32 [G, Mp] (returned transposed: strides (1, Mp)), Mp = M rounded up to
    row_align; and the launch constants of a program of BLOCK_M rows x one group (GROUP, BLOCK_M, num_warps)."""
    if group < 16 or group & (group - 1):
        raise ValueError(f"group={group} must be a power of 2 >= 16")
    Mp = -(-M // row_align) * row_align
    q = torch.empty(Mp, K, dtype=torch.float8_e4m3fn, device=device)
    s_buf = torch.empty(-(-K // group), Mp, dtype=torch.float32, device=device)
    block_m = min(16, triton.next_power_of_2(max(Mp, 1)))
    return q, s_buf, dict(GROUP=group, BLOCK_M=block_m, num_warps=4 if group * block_m >= 2048 else 1)


def gather_rows(
    qx: torch.Tensor,
    sx: torch.Tensor,
    sorted_ids: torch.Tensor,
    num_padded: torch.Tensor,
    topk: int,
    M: int,
    group: int = 128,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant's (qx [>= M, K], sx [>= M, G] with strides (1, .)) of M tokens -> the rows in moe_align's order:
    (q e4m3 [P, K], s fp32 [P, G] with strides (1, P)), P = len(sorted_ids); row m is token sorted_ids[m] // topk's,
    a padding id's row (>= M * topk) a quantized zero row; rows from num_padded on are left unset."""
    P, K = sorted_ids.shape[0], qx.shape[1]
    G = sx.shape[1]
    if sx.stride(0) != 1:
        raise ValueError(f"sx must be column-major (act_quant's), got strides {sx.stride()}")
    q = torch.empty(P, K, dtype=torch.float8_e4m3fn, device=qx.device)
    s_buf = torch.empty(G, P, dtype=torch.float32, device=qx.device)
    block_k = min(4 * group, max(group, triton.next_power_of_2(K)))
    if P and K:
        _gather_rows_kernel[(triton.cdiv(P, 32), triton.cdiv(K, block_k))](
            qx,
            sx,
            q,
            s_buf,
            sorted_ids,
            num_padded,
            M,
            P,
            K,
            G,
            qx.stride(0),
            sx.stride(1),
            q.stride(0),
            s_buf.stride(0),
            topk,
            GROUP=group,
            BLOCK_M=32,
            BLOCK_K=block_k,
            num_warps=4,
            **pdl_args(qx, pdl),
        )
    return q, s_buf.t()


def fp8_act_quant(x: torch.Tensor, group: int = 128, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], s fp32 [M, ceil(K/group)]), x ~= q * s per group of `group` channels
    of a row (fp8_reference.fp8_act_quant_ref, bit for bit). s is column-major (strides (1, M)), as scaled_mm's
    BlockWise1x128 wants it."""
    return act_quant(x, group, pdl=pdl)
