"""y = x @ W^T for a few rows of x (decode at small batch): a weight-streaming GEMV.

Each program owns BLOCK_N output columns and streams their [BLOCK_N, K] weight rows once, in BLOCK_K tiles
through a software pipeline; the (at most 16) rows of x are padded to the 16-row tile tl.dot takes, which costs
nothing here: the tensor cores idle while the weight bytes arrive. Narrow column blocks give enough programs to
keep every SM streaming (N=2048 at BLOCK_N=16: 128 programs).

With programmatic dependent launch (pdl.py) a program starts while the previous kernel is still running and first
prefetches its whole weight slab into L2 (weights are never written in a forward), so by the time x is ready the
bytes are on chip: the ~4 us a small GEMV otherwise spends waiting on HBM hides behind the kernel before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl, pdl_start, prefetch_l2

MAX_ROWS = 16  # rows of x one program holds (the tl.dot M tile)
MAX_PREFETCH_BYTES = 32 << 20  # larger weights (lm_head, dense MLPs) would not fit in L2: cuBLAS streams them well


@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if PDL:  # this program's weight rows into L2 (one address per 128-byte line) while the previous kernel runs
        line = tl.arange(0, LINES) * LINE_ELEMS
        rows = W + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
        for k0 in range(0, K, LINES * LINE_ELEMS):
            prefetch_l2(rows + tl.minimum(k0 + line, K - 1)[None, :], PDL)
    pdl_start(PDL)
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
    """H200, weights of 8 layers in turn, M=1 (kernels_bench decode_layers, 2026-11-29): 16-column blocks for
    N <= 2048 (o_proj 5.9 us, shared down 7.1 us), 32 above (q|kv_a 7.0 us, shared gate|up 6.7 us)."""
    return dict(BLOCK_N=16 if N <= 2048 else 32, BLOCK_K=256, num_warps=4, num_stages=4)


def use_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether layers send x @ w^T here: decode-sized bf16/fp16 inputs on a GPU with PDL (without it cuBLAS is as
    fast), and weights small enough to prefetch into L2."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == w.dtype and x.dtype in (torch.bfloat16,
            torch.float16) and w.numel() * w.element_size() <= MAX_PREFETCH_BYTES and pdl(x)
            and x.stride(-1) == 1 and w.stride(-1) == 1)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16), w [N, K], both bf16/fp16 with unit last stride -> out [M, N] (new in x.dtype, or the
    given buffer: x.dtype or fp32, unit last stride). Equals F.linear(x, w) up to fp32 summation order."""
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
    elif out.shape != (M, N) or out.dtype not in (x.dtype, torch.float32) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{M}, {N}] {x.dtype} or fp32 with a unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if M == 0:
        return out
    cfg = dict(gemv_config(M, N, K), **(config or {}))
    p = pdl(x) and cfg.get("PDL", True)  # config PDL=False: benchmarks
    lines = max(1, 4 * 32 * cfg["num_warps"] // cfg["BLOCK_N"])  # [BLOCK_N, LINES]: ~4 prefetches a thread
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], EVEN_K=K % cfg["BLOCK_K"] == 0,
        NUM_STAGES=cfg["num_stages"], PDL=p, LINES=triton.next_power_of_2(lines), LINE_ELEMS=128 // w.element_size(),
        num_warps=cfg["num_warps"],
        launch_pdl=p)
    return out
