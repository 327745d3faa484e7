"""A batch-invariant GEMM for deterministic mode: y = x @ w^T (or per batch: x[b] @ w[b]^T) with one BLOCK_K and one
K split for every M, fixed by the weight's shape, so each output row is the same bit for bit
whatever other rows share the launch (Thinking Machines' and SGLang's batch-invariant matmul; cuBLAS picks its
kernel and split-K by M).

Each program owns one [BLOCK_M, BLOCK_N] tile of one batch entry (64 x 64, or 128 x 128 on large grids: the tile
changes no bit). K is cut into S chunks of CHUNK (k_splits: a function of B, N and K only); each chunk is walked
from its start in BLOCK_K steps into an fp32 partial that starts at zero, and the row's result is 0 + p_0 + p_1 +
... + p_{S-1}, in that order, rounded once. Two launches compute exactly those operations:
    loop   one program per tile adds its partials as it goes (large M: enough tiles to fill the GPU)
    split  one program per (tile, chunk) writes its partial to an fp32 workspace [B, S, M, N], and a second kernel
           sums each row's partials in order (small M: a decode step's few tiles would leave most SMs idle)
so which one runs, chosen by M, changes no bit. Rows past M are loaded as zeros and never stored. M is not
specialized (do_not_specialize), so one binary per form serves every step size. Used by layers.linear, the lm_head,
the router and the absorbed projections when KernelConfig.deterministic is on (`--deterministic-inference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_release, pdl_wait

# the tile config that sets the K split (16-bit: mma tiles; fp32, tests: IEEE FMA dots in smaller tiles)
TILES_16 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
# 16-bit loop-form launches of >= 128 rows whose grid of these tiles has >= LARGE_MIN_PROGRAMS programs take them: the
# same BLOCK_K and K split, one wgmma a warpgroup over 128 columns, and the same bits (each element's sum over a
# BLOCK_K step does not depend on the tile: tests/gpu/test_deterministic_gpu.py), 1.1-2.5x faster at prefill sizes
# (kernels_bench --only bi_gemm; slower on grids smaller than that)
TILES_16_LARGE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
LARGE_MIN_PROGRAMS = 44
TILES_32 = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
# k_splits aims one M tile's (tile, chunk) programs at about two per SM of an H200 (132 SMs), each chunk at least
# two BLOCK_K steps; the split form runs while the loop form's programs would not fill the SMs once
SPLIT_PROGRAMS = 264
SPLIT_MIN_BLOCKS = 2
SPLIT_BELOW_PROGRAMS = 132
SUM_BLOCK_N = 512


def k_splits(B: int, N: int, K: int, cfg: dict) -> tuple[int, int]:
    """(S, CHUNK) for a [B, N, K] weight: S chunks of CHUNK (a multiple of BLOCK_K; the last may be short).
    Depends on nothing but the weight's shape and the tile config, so every M reduces in the same order."""
    tiles = B * triton.cdiv(N, cfg["BLOCK_N"])
    blocks = triton.cdiv(K, cfg["BLOCK_K"])
    s = max(1, min(SPLIT_PROGRAMS // max(tiles, 1), blocks // SPLIT_MIN_BLOCKS))
    per = triton.cdiv(blocks, s)
    return triton.cdiv(blocks, per), per * cfg["BLOCK_K"]


@triton.jit(do_not_specialize=["M"])
def _bi_gemm_kernel(
    X,
    W,
    Y,
    P,
    M,
    N,
    K,
    S,
    CHUNK,
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
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_release(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if SPLIT:  # axis 2: (batch entry, chunk); this program's one chunk
        b = (tl.program_id(2) // S).to(tl.int64)
        s_lo = tl.program_id(2) % S
        s_hi = s_lo + 1
    else:  # axis 2: batch entry; every chunk in order
        b = tl.program_id(2).to(tl.int64)
        s_lo = 0
        s_hi = S
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_base = X + b * sxb + offs_m.to(tl.int64)[:, None] * sxm + offs_k[None, :] * sxk  # [BM, BK]
    w_base = W + b * swb + offs_n.to(tl.int64)[None, :] * swn + offs_k[:, None] * swk  # [BK, BN]
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pdl_wait(PDL)
    for s in range(s_lo, s_hi):
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_lo = s * CHUNK
        for k0 in range(k_lo, tl.minimum(k_lo + CHUNK, K), BLOCK_K):
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_base + k0 * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + k0 * swk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            part = tl.dot(x, w, part, input_precision=DOT_PREC)
        if SPLIT:  # workspace [B, S, M, N] fp32
            p_ptr = P + ((b * S + s) * M + offs_m.to(tl.int64)[:, None]) * N + offs_n[None, :]
            tl.store(p_ptr, part, mask=m_ok[:, None] & n_ok[None, :])
        else:
            acc += part
    if not SPLIT:
        y_ptr = Y + b * syb + offs_m.to(tl.int64)[:, None] * sym + offs_n[None, :] * syn
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _bi_sum_kernel(P, Y, M, N, S, syb, sym, syn, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """The split form's second half: y[b, m, n-block] = 0 + p_0 + ... + p_{S-1}, rounded once."""
    pdl_release(PDL)
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    pdl_wait(PDL)
    for s in range(0, S):
        acc += tl.load(P + ((b * S + s) * M + m) * N + offs_n, mask=n_ok, other=0.0)
    tl.store(Y + b * syb + m * sym + offs_n * syn, acc.to(Y.dtype.element_ty), mask=n_ok)


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
    split: bool | None = None,
    tiles: dict | None = None,
) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N], or per batch entry x [B, M, K] @ w [B, N, K]^T -> [B, M, N]; any strides
    (w^T of a [B, K, N] weight is its transpose view). out: the caller's buffer (any strides), else a new tensor of
    out_dtype (default x.dtype). fp32 accumulation, rounded once to the output dtype. split: force the form (tests;
    default: by M, which changes no bit). tiles: another loop-form tile config with the same BLOCK_K (benchmarks:
    whether a larger tile's MMA gives the same bits; the K split stays the default config's)."""
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
    S, chunk = k_splits(B, N, K, cfg)
    if tiles is not None:
        if tiles["BLOCK_K"] != cfg["BLOCK_K"] or split:
            raise ValueError(f"bi_gemm: tiles {tiles} must keep BLOCK_K {cfg['BLOCK_K']} and the loop form")
        cfg, split = tiles, False
    m_tiles, n_tiles = triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"])
    if split is None:
        split = S > 1 and m_tiles * n_tiles * B < SPLIT_BELOW_PROGRAMS
    big = TILES_16_LARGE
    if tiles is None and not split and cfg is TILES_16 and M >= big["BLOCK_M"]:
        m_big, n_big = triton.cdiv(M, big["BLOCK_M"]), triton.cdiv(N, big["BLOCK_N"])
        if m_big * n_big * B >= LARGE_MIN_PROGRAMS:
            cfg, m_tiles, n_tiles = big, m_big, n_big
    part = torch.empty((B, S, M, N), dtype=torch.float32, device=x.device) if split else yb
    _bi_gemm_kernel[(n_tiles, m_tiles, B * S if split else B)](
        xb,
        wb,
        yb,
        part,
        M,
        N,
        K,
        S,
        chunk,
        *_strides(xb, batched),
        *_strides(wb, batched),
        *_strides(yb, batched),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        SPLIT=split,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_args(x, pdl),
    )
    if split:
        _bi_sum_kernel[(triton.cdiv(N, SUM_BLOCK_N), M, B)](
            part, yb, M, N, S, *_strides(yb, batched), BLOCK_N=SUM_BLOCK_N, num_warps=4, **pdl_args(x, pdl)
        )
    return out
