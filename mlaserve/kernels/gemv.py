"""y = x @ W^T for a few rows of x (decode at small batch): a weight-streaming GEMV.

Each program owns BLOCK_N output columns and streams their [BLOCK_N, K] weight rows once, in BLOCK_K tiles
through a deep software pipeline; the (at most 16) rows of x are padded to the 16-row tile tl.dot takes, which
costs nothing here: the tensor cores idle while the weight bytes arrive. Narrow column blocks give enough
programs to keep every SM streaming (N=2048 at BLOCK_N=16: 128 programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x one program holds (the tl.dot M tile)


@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptr = W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K, N] view of W's rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(x_ptr + k0, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptr + k0, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            x = tl.load(x_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
    y_ptr = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv_config(M: int, N: int, K: int) -> dict:
    return dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16), w [N, K], both bf16/fp16 with unit last stride -> out [M, N] (new, or the given buffer
    with unit last stride). Equals F.linear(x, w) up to fp32 summation order."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]")
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of x, got {M}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x {x.dtype} and w {w.dtype} must be one of bf16/fp16")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("x and w need a unit stride in their last dim")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{M}, {N}] {x.dtype} with a unit last stride, got {tuple(out.shape)} "
                         f"{out.dtype}")
    if M == 0:
        return out
    cfg = dict(gemv_config(M, N, K), **(config or {}))
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], EVEN_K=K % cfg["BLOCK_K"] == 0,
        NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"])
    return out
