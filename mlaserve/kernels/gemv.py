"""y = x @ W^T for a few rows of x (batch-1 decode): a weight-streaming GEMV that issues all its loads at once.

cuBLAS runs the batch-1 projections as 64x8-tile GEMMs that reach a third to a half of the HBM bandwidth on M1's
[2048, 2048] and [3648, 2048] weights (6.0 / 6.7 us, kernels_bench lin_decode). Here each program owns BLOCK_N
output columns and loads their [BLOCK_N, BLOCK_K] weight slab as one register tile (BLOCK_K = K: one trip, every
load in flight together), multiplies by x in fp32 and reduces over K, for each of up to GEMV_MAX_TOKENS rows of x.
layers.linear sends 1-2-row steps with up to KernelConfig.gemv_max_bytes of weight here (against cuBLAS it wins at 1
and 2 rows, not from 4 rows up: the crossover `kernels_bench --only lin_decode` measures), layer 0's dense MLP
included; layers.embedding sends the lm_head (fp32 out) at 1-2 rows. The A/Bs behind each: docs/experiments.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_config import KernelConfig
from .pdl import pdl_args, pdl_release, pdl_wait

# rows of x a launch serves (which steps come here: KernelConfig.gemv_serve_tokens and gemv_max_bytes)
GEMV_MAX_TOKENS = 8


@triton.jit
def _gemv_kernel(
    X,
    W,
    Y,
    N,
    K,
    stride_xt,
    stride_wn,
    stride_yt,
    T: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Y[t, n-block] = X[t] . W[n-block]^T for the T rows of X, from one weight tile per K step (the rows reuse it;
    each row's sum over K runs as the one-row kernel's does, so T=1 is unchanged)."""
    pdl_release(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            w = tl.load(W + n.to(tl.int64)[:, None] * stride_wn + (k0 + k)[None, :])
            pdl_wait(PDL)  # the weight tile is in flight before x is ready (pdl.py); later waits return at once
        else:
            ok = (n < N)[:, None] & ((k0 + k) < K)[None, :]
            w = tl.load(W + n.to(tl.int64)[:, None] * stride_wn + (k0 + k)[None, :], mask=ok, other=0.0)
            pdl_wait(PDL)
        for t in tl.static_range(T):
            if EVEN:
                x = tl.load(X + t * stride_xt + k0 + k)
            else:
                x = tl.load(X + t * stride_xt + k0 + k, mask=(k0 + k) < K, other=0.0)
            y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
            acc = tl.where((rows == t)[:, None], acc + y[None, :], acc)
    y_ptr = Y + rows[:, None] * stride_yt + n[None, :]
    # rounded to x's dtype first, as F.linear's output is: an fp32 Y (the lm_head's logits) holds F.linear(...).float()
    tl.store(y_ptr, acc.to(X.dtype.element_ty).to(Y.dtype.element_ty), mask=(rows < T)[:, None] & (n < N)[None, :])


def gemv_serves(
    x: torch.Tensor,
    w: torch.Tensor,
    max_bytes: int | None = KernelConfig.gemv_max_bytes,
    max_tokens: int = KernelConfig.gemv_serve_tokens,
) -> bool:
    """Whether layers.linear sends x @ w^T here: a CUDA step of 1..max_tokens rows in bf16/fp16 with unit last
    strides, times a weight of <= max_bytes (None: any; the lm_head) (decode's q|kv_a and o_proj at batch 1-2,
    EAGLE3's verify of width 2 at batch 1)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 1 <= x.shape[0] <= min(max_tokens, GEMV_MAX_TOKENS)
        and x.dtype == w.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and w.stride(-1) == 1
        and (max_bytes is None or w.numel() * w.element_size() <= max_bytes)
    )


def gemv_config(N: int, K: int) -> dict:
    """H200, M1's weights of 8 layers in turn (kernels_bench lin_decode, 2026-11-30): two columns a program, the
    whole K=2048 row in one trip, 2 warps: [2048, 2048] 3.9 us and [3648, 2048] 5.3 us against cuBLAS's 5.9 / 6.7;
    4 columns 4.5 / 5.8, 16 columns 5.5 / 6.5 (more, smaller programs keep more loads in flight)."""
    return dict(BLOCK_N=2, BLOCK_K=min(triton.next_power_of_2(K), 2048), num_warps=2)


def gemv(
    x: torch.Tensor, w: torch.Tensor, config: dict | None = None, out: torch.Tensor | None = None, pdl: bool = True
) -> torch.Tensor:
    """x [T, K] (T <= GEMV_MAX_TOKENS), w [N, K] (unit last strides, one dtype) -> [T, N] in x.dtype (new, or
    `out`, contiguous, in x.dtype or fp32: then F.linear's result cast to fp32); F.linear(x, w) up to fp32
    summation order. config (benchmarks, tests): BLOCK_N, BLOCK_K, num_warps."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_MAX_TOKENS or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} and w {tuple(w.shape)} must be [T, K] (1 <= T <= {GEMV_MAX_TOKENS}) and [N, K]"
        )
    if x.stride(-1) != 1 or w.stride(-1) != 1 or x.dtype != w.dtype:
        raise ValueError("x and w need one dtype and a unit last stride")
    T = x.shape[0]
    N, K = w.shape
    cfg = dict(gemv_config(N, K), **(config or {}))
    if out is None:
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    elif out.shape != (T, N) or out.dtype not in (x.dtype, torch.float32) or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous [{T}, {N}] {x.dtype} or fp32 tensor, got {tuple(out.shape)} {out.dtype}"
        )
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x,
        w,
        out,
        N,
        K,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        T=T,
        BLOCK_T=triton.next_power_of_2(T),
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        EVEN=N % cfg["BLOCK_N"] == 0 and K % cfg["BLOCK_K"] == 0,
        num_warps=cfg["num_warps"],
        **pdl_args(x, pdl),
    )
    return out
