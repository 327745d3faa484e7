"""silu(gate) * up as one kernel (torch launches two and writes silu(gate) out in between). gate and up may be
column views of one GEMM output; the product rounds silu(gate) to the input dtype first, exactly as
`F.silu(g) * u` does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def silu_mul(gate: torch.Tensor, up: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """gate, up [T, I] (unit last stride, any row stride) -> new [T, I] in their dtype."""
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
