"""y = x @ dequant(W)^T for a few rows of x (decode, verify): an FP8 weight-streaming GEMV (W8A16).

gemv.py's design with one byte a weight. Each program owns BLOCK_N output rows and streams their fp8 weights in
trips of BLOCK_K columns, as a [BLOCK_K/8, BLOCK_N, 8] tile: every thread holds 8 contiguous columns (one 8-byte
load) of all BLOCK_N rows, so the 8 x values it multiplies them by are loaded once for the rows, and its sum over
those 8 columns stays in the thread. Each such 8-column partial sum lies inside one 128-column scale block, so it
is scaled (weight_scale_inv[row // 128, col // 128]) and added to a per-thread fp32 accumulator; the threads' sums
are added once, after the last trip. Per weight: one e4m3 -> f16 conversion per pair (cvt packs), one f16 -> fp32,
one FMA per row of x; no cross-thread work inside the loop. (x's load takes 8 bf16 a thread, the same layout as the
weights' 8 bytes: 16 fp8 a thread would put x through shared memory every trip.)

x stays in its dtype (no activation quantization). The floor is half the bf16 GEMV's: N*K bytes of weight plus
N*K/16384 scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_reference import BLOCK
from .pdl import pdl_args, pdl_release, pdl_wait

FP8_GEMV_MAX_ROWS = 4  # rows of x a launch serves (each adds one FMA per weight byte)
VEC = 8  # columns a thread holds per row and chunk: one 8-byte weight load, one 16-byte bf16 x load


@triton.jit
def chunk_dot(wf, X, xk, x_ok, EVEN: tl.constexpr):
    """wf [C, R, VEC] fp32 weights; x = X[xk] ([C, VEC], masked by x_ok unless EVEN) -> [C, R]: each row's sum over
    each chunk of VEC columns (in-thread)."""
    if EVEN:
        x = tl.load(X + xk)
    else:
        x = tl.load(X + xk, mask=x_ok, other=0.0)
    return tl.sum(wf * x.to(tl.float32)[:, None, :], 2)


@triton.jit
def weight_trip(
    w_ptr, s_ptr, k0, K, n_ok, kk, c, stride_sk, GROUP: tl.constexpr, VEC: tl.constexpr, EVEN: tl.constexpr
):
    """One trip's fp8 tile [C, R, VEC] and scales [C, R] from column k0 (EVEN: no masks, the trip lies inside)."""
    if EVEN:
        w = tl.load(w_ptr + k0)
        sc = tl.load(s_ptr + (k0 // GROUP) * stride_sk)
    else:
        k_ok = (k0 + kk) < K
        w = tl.load(w_ptr + k0, mask=n_ok[None, :, None] & k_ok[:, None, :], other=0.0)
        sc_ok = n_ok[None, :] & (k0 + c * VEC < K)[:, None]
        sc = tl.load(s_ptr + (k0 // GROUP) * stride_sk, mask=sc_ok, other=0.0)
    return w, sc


@triton.jit
def _trip_dots(w, sc, X, stride_xt, xk, x_ok, acc0, acc1, acc2, acc3, T: tl.constexpr, EVEN: tl.constexpr):
    """One trip's tile w [C, R, VEC] and scales sc [C, R] against the T rows of x at columns xk [C, VEC]."""
    wf = w.to(tl.float32)
    acc0 += chunk_dot(wf, X, xk, x_ok, EVEN) * sc
    if T > 1:
        acc1 += chunk_dot(wf, X + stride_xt, xk, x_ok, EVEN) * sc
    if T > 2:
        acc2 += chunk_dot(wf, X + 2 * stride_xt, xk, x_ok, EVEN) * sc
    if T > 3:
        acc3 += chunk_dot(wf, X + 3 * stride_xt, xk, x_ok, EVEN) * sc
    return acc0, acc1, acc2, acc3


@triton.jit
def _fp8_gemv_kernel(
    X,
    W,
    S,
    Y,
    N,
    K,
    stride_xt,
    stride_xk,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_yt,
    T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    VEC: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Y[t, n-block] for t < T (<= 4): trips of a [C, BLOCK_N, VEC] fp8 tile (C = BLOCK_K / VEC chunks) and its
    scales [C, BLOCK_N] (chunk c of a row uses its block's), two trips loaded per loop step (both in flight before
    either is used; a loop-carried prefetch would hold the fp8 bytes one to a register), then the last one or two;
    each x row's scaled chunk sums go into acc_t."""
    pdl_release(PDL)
    C: tl.constexpr = BLOCK_K // VEC
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, C)
    kk = c[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [C, VEC] columns of a trip
    n_ok = n < N
    w_ptr = W + n.to(tl.int64)[None, :, None] * stride_wn + kk[:, None, :]  # [C, R, VEC]
    s_ptr = S + (n // GROUP).to(tl.int64)[None, :] * stride_sn + (c // (GROUP // VEC))[:, None] * stride_sk
    acc0 = tl.zeros([C, BLOCK_N], tl.float32)
    acc1 = tl.zeros([C, BLOCK_N], tl.float32)
    acc2 = tl.zeros([C, BLOCK_N], tl.float32)
    acc3 = tl.zeros([C, BLOCK_N], tl.float32)
    K2 = K // (2 * BLOCK_K) * (2 * BLOCK_K)
    for k0 in range(0, K2, 2 * BLOCK_K):
        wa, sa = weight_trip(w_ptr, s_ptr, k0, K, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        wb, sb = weight_trip(w_ptr, s_ptr, k0 + BLOCK_K, K, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        pdl_wait(PDL)  # the first weight trips are in flight before x is ready (pdl.py); later waits return at once
        xa = (k0 + kk) * stride_xk
        xb = (k0 + BLOCK_K + kk) * stride_xk
        acc0, acc1, acc2, acc3 = _trip_dots(wa, sa, X, stride_xt, xa, xa < K, acc0, acc1, acc2, acc3, T, EVEN)
        acc0, acc1, acc2, acc3 = _trip_dots(wb, sb, X, stride_xt, xb, xb < K, acc0, acc1, acc2, acc3, T, EVEN)
    if K2 < K:  # the last one or two trips (masked unless EVEN)
        wc, sc = weight_trip(w_ptr, s_ptr, K2, K, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        if K2 + BLOCK_K < K:
            wd, sd = weight_trip(w_ptr, s_ptr, K2 + BLOCK_K, K, n_ok, kk, c, stride_sk, GROUP, VEC, EVEN)
        else:
            wd, sd = wc, sc  # unused
        pdl_wait(PDL)
        xc = (K2 + kk) * stride_xk
        acc0, acc1, acc2, acc3 = _trip_dots(wc, sc, X, stride_xt, xc, (K2 + kk) < K, acc0, acc1, acc2, acc3, T, EVEN)
        if K2 + BLOCK_K < K:
            xd = (K2 + BLOCK_K + kk) * stride_xk
            x_ok = (K2 + BLOCK_K + kk) < K
            acc0, acc1, acc2, acc3 = _trip_dots(wd, sd, X, stride_xt, xd, x_ok, acc0, acc1, acc2, acc3, T, EVEN)
    out = Y.dtype.element_ty
    tl.store(Y + n, tl.sum(acc0, 0).to(out), mask=n_ok)
    if T > 1:
        tl.store(Y + stride_yt + n, tl.sum(acc1, 0).to(out), mask=n_ok)
    if T > 2:
        tl.store(Y + 2 * stride_yt + n, tl.sum(acc2, 0).to(out), mask=n_ok)
    if T > 3:
        tl.store(Y + 3 * stride_yt + n, tl.sum(acc3, 0).to(out), mask=n_ok)


def fp8_gemv_config(N: int, K: int) -> dict:
    """Four rows a program (each thread's x chunk serves all four) and trips of the largest power of 2 up to 1024
    columns that divides K (DeepSeek-V3's K = 7168, 16384, 18432, 2048: 1024; 1536: 512; no masks), one 8-byte
    chunk a row a thread: 128 threads (4 warps) for 1024 columns. kernels_bench --only fp8_linear sweeps rows,
    trip and warps."""
    bk = 1024
    while bk > BLOCK and K % bk:
        bk //= 2
    if K % bk:  # K off the 128 grid: one masked tail trip
        bk = min(1024, max(triton.next_power_of_2(K), BLOCK))
    return dict(BLOCK_N=4, BLOCK_K=bk, num_warps=max(1, min(4, bk // (VEC * 32))))


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    out: torch.Tensor,
    config: dict | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """x [T, K] (T <= FP8_GEMV_MAX_ROWS, any strides), w e4m3 [N, K] (unit last stride), scale_inv fp32
    [ceil(N/128), ceil(K/128)] -> out [T, N] (x.dtype, unit last stride; the caller checked shapes). config:
    BLOCK_N (a power of 2), BLOCK_K (a power of 2, 128 .. 8192: each thread takes BLOCK_K / (8 * 32 * num_warps)
    chunks of 8 columns a row), num_warps. pdl: KernelConfig.pdl."""
    T, K = x.shape
    N = w.shape[0]
    if not 1 <= T <= FP8_GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv serves 1 to {FP8_GEMV_MAX_ROWS} rows of x, got {T}")
    cfg = fp8_gemv_config(N, K)
    bad = [k for k in config or {} if k not in cfg]
    if bad:
        raise ValueError(f"fp8_gemv config keys {bad} are not among {list(cfg)}")
    cfg.update(config or {})
    bk, bn = cfg["BLOCK_K"], cfg["BLOCK_N"]
    if bk < BLOCK or bk > 8192 or bk & (bk - 1) or bn & (bn - 1):
        raise ValueError(f"fp8_gemv BLOCK_K={bk} must be a power of 2 in [{BLOCK}, 8192], BLOCK_N={bn} a power of 2")
    _fp8_gemv_kernel[(triton.cdiv(N, bn),)](
        x,
        w,
        scale_inv,
        out,
        N,
        K,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        scale_inv.stride(0),
        scale_inv.stride(1),
        out.stride(0),
        T=T,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP=BLOCK,
        VEC=VEC,
        EVEN=N % bn == 0 and K % bk == 0,
        num_warps=cfg["num_warps"],
        **pdl_args(x, pdl),
    )
    return out
