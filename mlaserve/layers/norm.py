"""RMSNorm, computed in fp32 and cast back, exactly as transformers' DeepseekV3RMSNorm. Called with a residual,
it first adds it (the decoder layer's `h + out`) and returns the sum too: one kernel for both on the GPU."""

import torch
from torch import nn

from ..kernel_config import KernelConfig
from .linear import new_param


class RMSNorm(nn.Module):
    kernels = KernelConfig()  # the model's, once built (kernel_config.use_kernels)

    def __init__(self, dim: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = new_param(dim, dtype=dtype)

    def uses_kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        """Whether forward runs the Triton kernel (kernels/rmsnorm.py) rather than the torch form. A kernel that
        fuses this norm in (the MoE's sum, DeepseekV3MoE) may do so only then: it rounds as that kernel does."""
        return (
            x.is_cuda
            and x.dim() == 2
            and x.dtype == self.weight.dtype
            and (residual is None or residual.dtype == x.dtype)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        rows: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ):
        """-> norm(x); with `residual`: (norm(x + residual), x + residual). rows [R]: of x[rows] (and
        residual[rows]) only, gathered by the kernel itself on the GPU. out (no residual): the norm's output, any
        row stride."""
        kernel = self.uses_kernel(x, residual)
        if residual is not None:
            if out is not None:
                raise ValueError("RMSNorm: out is for the norm without a residual")
            if kernel:
                from ..kernels.rmsnorm import add_rms_norm

                return add_rms_norm(x, residual, self.weight, self.eps, pdl=self.kernels.pdl, rows=rows)
            if rows is not None:
                x, residual = x[rows], residual[rows]
            s = x + residual
            return self(s), s
        if kernel:  # one kernel on the GPU
            from ..kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, pdl=self.kernels.pdl, rows=rows, out=out)
        if rows is not None:
            x = x[rows]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * h.to(x.dtype)
        return y if out is None else out.copy_(y)
