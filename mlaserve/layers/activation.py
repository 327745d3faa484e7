"""SiLU-and-mul: silu(gate) * up, on a fused [.., 2I] gate|up tensor or on two [T, I] views."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    g, u = x.chunk(2, dim=-1)
    return silu_mul(g, u, pdl)


def silu_mul(g: torch.Tensor, u: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """pdl: KernelConfig.pdl, for the fused kernel."""
    if g.is_cuda and g.dim() == 2:  # one fused kernel on the GPU
        from ..kernels.silu_mul import silu_mul as fused

        return fused(g, u, pdl)
    return F.silu(g) * u
