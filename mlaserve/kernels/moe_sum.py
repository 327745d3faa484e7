"""The fused MoE's last step: the sum over top-k of its per-(token, k) rows, optionally with the residual add +
RMSNorm that follows the MoE block fused in (one launch instead of two, bit-equal to the pair).

`moe_sum(y, topk_ids, ...)` -> the MoE output; with `norm=(weight, eps, residual)` -> (norm(out + residual),
out + residual) exactly as rmsnorm.add_rms_norm(out, residual, weight, eps) returns them: the same roundings, and
one program per row launched as the norms are (rmsnorm._launch_args), so the norm's reduction runs in the same order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_release, pdl_start, pdl_wait
from .rmsnorm import _add_norm_row, _check, _launch_args


@triton.jit
def _topk_sum_row(
    Y,
    TopkIds,
    Add,
    t,
    offs,
    ok,
    D,
    expert_offset,
    E_LOCAL,
    stride_add,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_ADD: tl.constexpr,
    ALL_OWN: tl.constexpr,
):
    """Row t of the MoE output in fp32, to be rounded to Y's dtype: sum over k of Y[(t, k)] in k order, skipping
    experts this rank does not own (their rows were never written); plus Add[t] (the shared experts' output)
    after rounding the sum, as `routed + shared` in the dtype rounds. ALL_OWN (no expert parallelism: every
    row was written): the ids are not read, so every row load issues at once after the wait (the id -> row
    chain cost two more L2 round trips)."""
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOPK):
        row = Y + (t * TOPK + k).to(tl.int64) * D + offs
        if ALL_OWN:
            acc += tl.load(row, mask=ok, other=0.0).to(tl.float32)
        else:
            e = tl.load(TopkIds + t * TOPK + k) - expert_offset
            # a masked load, not a branch: all K rows are in flight at once (a branch per row waited for each
            # load in turn: 4.3 us per batch-1 row on the H200). Adding the masked 0.0 is exact: acc starts at
            # +0.0 and is never -0.0, so acc + 0.0 == acc bit for bit.
            own = (e >= 0) & (e < E_LOCAL)
            acc += tl.load(row, mask=ok & own, other=0.0).to(tl.float32)
    if HAS_ADD:
        acc = acc.to(Y.dtype.element_ty).to(tl.float32) + tl.load(
            Add + t.to(tl.int64) * stride_add + offs, mask=ok, other=0.0
        ).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["expert_offset"])
def _moe_sum_kernel(
    Y,
    TopkIds,
    Out,
    Add,
    D,
    expert_offset,
    E_LOCAL,
    stride_add,
    TOPK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_ADD: tl.constexpr,
    ALL_OWN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Out[t] = the MoE output row t; programs (token, BLOCK_D columns)."""
    pdl_start(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    acc = _topk_sum_row(
        Y, TopkIds, Add, t, offs, ok, D, expert_offset, E_LOCAL, stride_add, TOPK, BLOCK_D, HAS_ADD, ALL_OWN
    )
    tl.store(Out + t.to(tl.int64) * D + offs, acc.to(Out.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["expert_offset"])
def _moe_sum_norm_kernel(
    Y,
    TopkIds,
    Add,
    Res,
    W,
    Out,
    Sum,
    D,
    expert_offset,
    E_LOCAL,
    stride_add,
    stride_r,
    stride_o,
    stride_s,
    eps,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_ADD: tl.constexpr,
    ALL_OWN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Sum[t] = round(moe_out[t] + Res[t]), Out[t] = norm(Sum[t]); one program per token, the whole row.
    moe_out[t] is rounded to the dtype as _moe_sum_kernel stores it; the rest is _add_rmsnorm_kernel's row."""
    pdl_release(PDL)
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    ok = d < D
    w = tl.load(W + d, mask=ok, other=0.0)  # a weight: before the wait (rmsnorm._norm_row)
    pdl_wait(PDL)
    acc = _topk_sum_row(Y, TopkIds, Add, t, d, ok, D, expert_offset, E_LOCAL, stride_add, TOPK, BLOCK, HAS_ADD, ALL_OWN)
    x = acc.to(Y.dtype.element_ty).to(tl.float32)
    r = tl.load(Res + t.to(tl.int64) * stride_r + d, mask=ok, other=0.0).to(tl.float32)
    _add_norm_row(x, r, w, Out, Sum, t.to(tl.int64), stride_o, stride_s, d, ok, D, eps)


def moe_sum(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int,
    num_local: int,
    add: torch.Tensor | None = None,
    norm: tuple | None = None,
    all_local: bool = False,
    pdl: bool = True,
):
    """y [T*K, D] (row t*K + k: token t's k-th expert, top-k weight applied; rows of experts outside
    [offset, offset + num_local) unwritten), topk_ids [T, K] -> out [T, D] in y.dtype (+ add [T, D] after rounding).
    norm = (weight [D], eps, residual [T, D]) -> (norm(out + residual), out + residual) instead. all_local: this
    rank owns every expert the ids can name (no expert parallelism), so every row was written and the ids are
    not read."""
    T, K = topk_ids.shape
    D = y.shape[1]
    if y.shape != (T * K, D) or y.stride() != (D, 1):
        raise ValueError(f"y must be a contiguous [{T * K}, D], got {tuple(y.shape)} strides {y.stride()}")
    if add is not None and (add.shape != (T, D) or add.dtype != y.dtype or add.stride(-1) != 1):
        raise ValueError(
            f"add must be [{T}, {D}] {y.dtype} with a unit last stride, got {tuple(add.shape)} {add.dtype}"
        )
    add_args = dict(
        Add=y if add is None else add,
        stride_add=0 if add is None else add.stride(0),
        HAS_ADD=add is not None,
        ALL_OWN=bool(all_local),
    )
    if norm is None:
        out = torch.empty(T, D, dtype=y.dtype, device=y.device)
        block_d = min(1024, triton.next_power_of_2(D))
        if T:
            _moe_sum_kernel[(T, triton.cdiv(D, block_d))](
                y,
                topk_ids,
                out,
                D=D,
                expert_offset=expert_offset,
                E_LOCAL=num_local,
                TOPK=K,
                BLOCK_D=block_d,
                num_warps=4,
                **add_args,
                **pdl_args(y, pdl),
            )
        return out
    weight, eps, residual = norm
    if weight.shape != (D,) or residual.shape != (T, D):
        raise ValueError(
            f"norm weight {tuple(weight.shape)} / residual {tuple(residual.shape)} must be [{D}] / [{T}, {D}]"
        )
    _check(residual, weight)
    if weight.dtype != y.dtype:
        raise ValueError(f"norm weight and residual must be {y.dtype}, got {weight.dtype}")
    out = torch.empty(T, D, dtype=y.dtype, device=y.device)
    s = torch.empty(T, D, dtype=y.dtype, device=y.device)
    if T:
        _moe_sum_norm_kernel[(T,)](
            y,
            topk_ids,
            Res=residual,
            W=weight,
            Out=out,
            Sum=s,
            D=D,
            expert_offset=expert_offset,
            E_LOCAL=num_local,
            stride_r=residual.stride(0),
            stride_o=out.stride(0),
            stride_s=s.stride(0),
            eps=eps,
            TOPK=K,
            **add_args,
            **_launch_args(D),
            **pdl_args(y, pdl),
        )
    return out, s
