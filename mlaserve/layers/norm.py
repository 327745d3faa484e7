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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """-> norm(x); with `residual`: (norm(x + residual), x + residual)."""
        kernel = self.uses_kernel(x, residual)
        if residual is not None:
            if kernel:
                from ..kernels.rmsnorm import add_rms_norm

                return add_rms_norm(x, residual, self.weight, self.eps, pdl=self.kernels.pdl)
            s = x + residual
            return self(s), s
        if kernel:  # one kernel on the GPU
            from ..kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, pdl=self.kernels.pdl)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
