"""A batch-invariant GEMM for deterministic mode: y = x @ w^T (or per batch: x[b] @ w[b]^T) with one tile config for
every M, a fixed BLOCK_K and no split-K, so each output row is the same bit for bit whatever other rows share the
launch (Thinking Machines' and SGLang's batch-invariant matmul; cuBLAS picks its kernel and split-K by M).

Each program owns one [BLOCK_M, BLOCK_N] tile of one batch entry and walks K from 0 in BLOCK_K steps into an fp32
accumulator; rows past M are loaded as zeros and never stored. M is not specialized (do_not_specialize), so one
binary serves every step size. Used by layers.linear, the lm_head, the router and the absorbed projections when
KernelConfig.deterministic is on (`--deterministic-inference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_release, pdl_wait

# the one tile config (16-bit: mma tiles; fp32, tests: IEEE FMA dots in smaller tiles)
TILES_16 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
TILES_32 = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _bi_gemm_kernel(
    X,
    W,
    Y,
    M,
    N,
    K,
    sxb,
    sxm,
    sxk,
    swb,
    swn,
    swk,
    syb,
    sym,
    syn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_release(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptr = X + b * sxb + offs_m.to(tl.int64)[:, None] * sxm + offs_k[None, :] * sxk  # [BM, BK]
    w_ptr = W + b * swb + offs_n.to(tl.int64)[None, :] * swn + offs_k[:, None] * swk  # [BK, BN]
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pdl_wait(PDL)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PREC)
        x_ptr += BLOCK_K * sxk
        w_ptr += BLOCK_K * swk
    y_ptr = Y + b * syb + offs_m.to(tl.int64)[:, None] * sym + offs_n[None, :] * syn
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _strides(t: torch.Tensor, batched: bool) -> tuple[int, int, int]:
    """A [B, rows, cols] view's strides, the batch one 0 when unbatched: no argument of the launch then depends on
    M (a stride M*K would be specialized differently at different M)."""
    s = t.stride()
    return (s[0] if batched else 0, s[1], s[2])


def bi_gemm_serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether bi_gemm takes x [.., M, K] @ w [.., N, K]^T: floating x and w of one dtype, 2-D or 3-D alike."""
    return x.dtype == w.dtype and x.dtype in FLOATS and x.dim() == w.dim() and x.dim() in (2, 3)


def bi_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N], or per batch entry x [B, M, K] @ w [B, N, K]^T -> [B, M, N]; any strides
    (w^T of a [B, K, N] weight is its transpose view). out: the caller's buffer (any strides), else a new tensor of
    out_dtype (default x.dtype). fp32 accumulation, rounded once to the output dtype."""
    if not bi_gemm_serves(x, w):
        raise ValueError(
            f"bi_gemm: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} must be 2-D or 3-D alike in one "
            f"of {FLOATS}"
        )
    batched = x.dim() == 3
    xb, wb = (x, w) if batched else (x.unsqueeze(0), w.unsqueeze(0))
    B, M, K = xb.shape
    if wb.shape[0] != B or wb.shape[2] != K:
        raise ValueError(
            f"bi_gemm: w {tuple(w.shape)} must be [{'B, ' if batched else ''}N, {K}] for x {tuple(x.shape)}"
        )
    N = wb.shape[1]
    shape = (B, M, N) if batched else (M, N)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype or x.dtype, device=x.device)
    elif tuple(out.shape) != shape or out.dtype not in FLOATS:
        raise ValueError(f"bi_gemm: out {tuple(out.shape)} {out.dtype} must be {shape} in one of {FLOATS}")
    yb = out if batched else out.unsqueeze(0)
    if M == 0 or N == 0 or B == 0:
        return out
    cfg = TILES_32 if x.dtype == torch.float32 else TILES_16
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]), B)
    _bi_gemm_kernel[grid](
        xb,
        wb,
        yb,
        M,
        N,
        K,
        *_strides(xb, batched),
        *_strides(wb, batched),
        *_strides(yb, batched),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_args(x, pdl),
    )
    return out
