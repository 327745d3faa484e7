"""RMSNorm, computed in fp32 and cast back, exactly as transformers' DeepseekV3RMSNorm."""

import torch
from torch import nn

from .linear import new_param


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = new_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and x.dtype == self.weight.dtype:  # one fused kernel on the GPU
            from ..kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
