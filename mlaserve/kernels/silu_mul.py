"""silu(gate) * up as one kernel (torch launches two and writes silu(gate) out in between). gate and up may be
column views of one GEMM output; the product rounds silu(gate) to the input dtype first, exactly as
`F.silu(g) * u` does.

silu_mul_quant: the same product, rounded to the input dtype as silu_mul writes it, then quantized per token per
128 channels in the same program (fp8_quant.py's act_quant), for a W8A8 down projection: its bf16 [T, I] is never
written. Same bits as act_quant(silu_mul(gate, up))."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import quant_group, quant_outputs
from .pdl import pdl_args, pdl_start


@triton.jit
def _silu_mul_kernel(G, U, Out, stride_g, stride_u, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    g = tl.load(G + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=ok, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(Out + row * stride_o + offs, (s.to(tl.float32) * u.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if (
        gate.dim() != 2
        or gate.shape != up.shape
        or gate.dtype != up.dtype
        or gate.stride(-1) != 1
        or up.stride(-1) != 1
    ):
        raise ValueError(
            f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must be "
            "[T, I] of one dtype with a unit last stride"
        )


def silu_mul(gate: torch.Tensor, up: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """gate, up [T, I] (unit last stride, any row stride) -> new [T, I] in their dtype."""
    _check(gate, up)
    T, I = gate.shape
    out = torch.empty(T, I, dtype=gate.dtype, device=gate.device)
    if T:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul_kernel[(T, triton.cdiv(I, block))](
            gate,
            up,
            out,
            gate.stride(0),
            up.stride(0),
            out.stride(0),
            I,
            BLOCK=block,
            num_warps=4,
            **pdl_args(gate, pdl),
        )
    return out


@triton.jit(do_not_specialize=["T", "TP"])
def _silu_mul_quant_kernel(
    G,
    U,
    Q,
    S,
    T,
    TP,
    I,
    stride_g,
    stride_u,
    stride_q,
    stride_sg,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row block, group c): Q[rows, c*GROUP ..], S[c, rows] for rows < TP; rows in [T, TP) get q = 0."""
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1)
    k = c * GROUP + tl.arange(0, GROUP)
    ok = (rows < T)[:, None] & (k < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(G + r64 * stride_g + k[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + r64 * stride_u + k[None, :], mask=ok, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    h = (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)  # what silu_mul writes
    q, sc = quant_group(h.to(tl.float32))
    tl.store(Q + r64 * stride_q + k[None, :], q, mask=(rows < TP)[:, None] & (k < I)[None, :])
    tl.store(S + c * stride_sg + rows, sc, mask=rows < TP)


def silu_mul_quant(
    gate: torch.Tensor, up: torch.Tensor, group: int = 128, row_align: int = 1, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate, up [T, I] (as silu_mul) -> act_quant(silu_mul(gate, up), group, row_align)'s (q e4m3 [Tp, I], s fp32
    [Tp, ceil(I/group)] with strides (1, Tp)), Tp = T rounded up to row_align (padding rows: q = 0)."""
    _check(gate, up)
    T, I = gate.shape
    q, s_buf, launch = quant_outputs(T, I, group, row_align, gate.device)
    Tp, G, block_m = q.shape[0], s_buf.shape[0], launch["BLOCK_M"]
    if Tp and I:
        _silu_mul_quant_kernel[(triton.cdiv(Tp, block_m), G)](
            gate,
            up,
            q,
            s_buf,
            T,
            Tp,
            I,
            gate.stride(0),
            up.stride(0),
            q.stride(0),
            s_buf.stride(0),
            **launch,
            **pdl_args(gate, pdl),
        )
    return q, s_buf.t()
