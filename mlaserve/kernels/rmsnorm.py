"""RMSNorm as one kernel (the torch form launches ~6): fp32 statistics, cast back, times the weight in the input
dtype, exactly layers.norm.RMSNorm's rounding. One program per row; rows may be strided views.

`add_rms_norm` also folds in the residual add that precedes every norm of a decoder layer: s = x + residual
(rounded to the dtype, as `h + out` is), written out as the new residual stream, and norm(s).

Both take `rows` (int32 or int64 [R], any stride): output row i is the norm of input row rows[i], so a gather
before the norm (an embedding lookup, the rows a draft takes) costs no launch of its own; a row is normed alone, so
its bits are those of the whole-tensor call's row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_release, pdl_wait


@triton.jit
def _norm_row(x, w, Out, row, stride_o, d, ok, D, eps):
    """x: one row in fp32 (already rounded to the input dtype); w: the norm weight's row, loaded by the caller
    before its PDL wait (a weight: evicted by the step's expert streams, so a DRAM round trip; loaded here, after
    the stores before it, it was one more round trip at the end of every norm)."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * rstd).to(Out.dtype.element_ty)  # the reference casts before the weight
    tl.store(Out + row * stride_o + d, (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _rmsnorm_kernel(
    X, W, Out, Rows, stride_x, stride_o, stride_rows, D, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr
):
    pdl_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < D
    w = tl.load(W + d, mask=ok, other=0.0)  # a weight: before the wait
    pdl_wait(PDL)
    src = tl.load(Rows + row * stride_rows).to(tl.int64) if ROWS else row
    x = tl.load(X + src * stride_x + d, mask=ok, other=0.0).to(tl.float32)
    _norm_row(x, w, Out, row, stride_o, d, ok, D, eps)


@triton.jit
def _add_norm_row(x, r, w, Out, Sum, row, stride_o, stride_s, d, ok, D, eps):
    """x, r: one row and its residual in fp32 (already rounded to the dtype); w: the norm weight (_norm_row).
    Stores s = x + r rounded to the dtype (the new residual stream), then norm(s). Also the tail of the MoE's fused
    sum over top-k (moe_sum.py)."""
    s = (x + r).to(Sum.dtype.element_ty)
    tl.store(Sum + row * stride_s + d, s, mask=ok)
    _norm_row(s.to(tl.float32), w, Out, row, stride_o, d, ok, D, eps)


@triton.jit
def _add_rmsnorm_kernel(
    X,
    Res,
    W,
    Out,
    Sum,
    Rows,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    stride_rows,
    D,
    eps,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < D
    w = tl.load(W + d, mask=ok, other=0.0)  # a weight: before the wait
    pdl_wait(PDL)
    src = tl.load(Rows + row * stride_rows).to(tl.int64) if ROWS else row
    x = tl.load(X + src * stride_x + d, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(Res + src * stride_r + d, mask=ok, other=0.0).to(tl.float32)
    _add_norm_row(x, r, w, Out, Sum, row, stride_o, stride_s, d, ok, D, eps)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1 or weight.dtype != x.dtype:
        raise ValueError(
            f"x: need [T, D] with a contiguous last dim and weight of x's dtype, got {tuple(x.shape)} "
            f"{x.dtype} / weight {weight.dtype}"
        )


def _launch_args(D: int) -> dict:
    """One program per row: BLOCK and num_warps fix the layout of the row, so the order of the norm's reduction.
    Every kernel that must round as these norms do launches with these (rope_kv.py, moe_sum.py)."""
    block = triton.next_power_of_2(D)
    return dict(BLOCK=block, num_warps=min(max(block // 256, 1), 16))


def _check_rows(rows: torch.Tensor | None, x: torch.Tensor) -> int:
    """-> the output's row count: len(rows), or x's rows."""
    if rows is None:
        return x.shape[0]
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != x.device:
        raise ValueError(f"rows: need a 1-D int32/int64 tensor on {x.device}, got {tuple(rows.shape)} {rows.dtype}")
    return rows.shape[0]


def _out(out: torch.Tensor | None, T: int, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(T, x.shape[1], dtype=x.dtype, device=x.device)
    if out.shape != (T, x.shape[1]) or out.dtype != x.dtype or out.stride(-1) != 1 or out.device != x.device:
        raise ValueError(
            f"out: need [{T}, {x.shape[1]}] {x.dtype} with a contiguous last dim on {x.device}, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pdl: bool = True,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D] (last dim contiguous, any row stride) -> [T, D] in x.dtype (out, any row stride, or a new tensor);
    with rows [R] (any stride): [R, D], the norm of x[rows] (values in [0, T), unchecked). pdl: kernels/pdl.py."""
    _check(x, weight)
    T = _check_rows(rows, x)
    out = _out(out, T, x)
    if T:
        _rmsnorm_kernel[(T,)](
            x,
            weight,
            out,
            out if rows is None else rows,
            x.stride(0),
            out.stride(0),
            0 if rows is None else rows.stride(0),
            x.shape[1],
            eps,
            ROWS=rows is not None,
            **_launch_args(x.shape[1]),
            **pdl_args(x, pdl),
        )
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pdl: bool = True,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, D] -> (norm(x + residual), x + residual), both new tensors in x.dtype; with rows [R]: of
    x[rows] + residual[rows], [R, D] each."""
    _check(x, weight)
    _check(residual, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    T = _check_rows(rows, x)
    out, s = _out(None, T, x), _out(None, T, x)
    if T:
        _add_rmsnorm_kernel[(T,)](
            x,
            residual,
            weight,
            out,
            s,
            out if rows is None else rows,
            x.stride(0),
            residual.stride(0),
            out.stride(0),
            s.stride(0),
            0 if rows is None else rows.stride(0),
            x.shape[1],
            eps,
            ROWS=rows is not None,
            **_launch_args(x.shape[1]),
            **pdl_args(x, pdl),
        )
    return out, s
