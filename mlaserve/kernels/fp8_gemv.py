"""y = x @ dequant(W)^T for a few rows of x (decode, verify): an FP8 weight-streaming GEMV (W8A16).

gemv.py's design with one byte a weight: each program owns BLOCK_N output rows and loads their [BLOCK_N, BLOCK_K]
fp8 slab as one register tile, viewed as [BLOCK_N, BLOCK_K/128, 128] so that every 128-column block's partial sum
meets its weight_scale_inv entry in fp32 (scale [BLOCK_N, BLOCK_K/128], loaded beside the tile), then sums over
the blocks. x stays in its dtype (no activation quantization: one launch, exact activations); the T rows of x
reuse each weight tile. The floor is half the bf16 GEMV's: N*K bytes of weight plus N*K/16384 scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_reference import BLOCK
from .pdl import pdl_args, pdl_release, pdl_wait

FP8_GEMV_MAX_ROWS = 8  # rows of x a launch serves (the T rows share each weight tile)


@triton.jit
def block_dot(w, x, sc):
    """w [R, G, 128] fp8 (or any), x [G, 128] fp32, sc [R, G] fp32 -> [R] = sum_g sc[r, g] * (w[r, g] . x[g])."""
    return tl.sum(tl.sum(w.to(tl.float32) * x[None, :, :], 2) * sc, 1)


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
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Y[t, n-block] = sum over the K trips of GROUPS 128-column blocks of X[t] . (W[n-block] * S)^T."""
    pdl_release(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, GROUPS)
    c = tl.arange(0, GROUP)
    rows = tl.arange(0, BLOCK_T)
    n_ok = n < N
    w_row = W + n.to(tl.int64)[:, None, None] * stride_wn
    s_row = S + (n // GROUP).to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, GROUPS * GROUP):
        k = k0 + g[:, None] * GROUP + c[None, :]  # [G, 128]
        k_ok = k < K
        w = tl.load(w_row + k[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0)
        gk = k0 // GROUP + g
        sc = tl.load(s_row + gk[None, :] * stride_sk, mask=n_ok[:, None] & (gk * GROUP < K)[None, :], other=0.0)
        pdl_wait(PDL)  # the weight tile is in flight before x is ready (pdl.py); later waits return at once
        for t in tl.static_range(T):
            x = tl.load(X + t * stride_xt + k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
            y = block_dot(w, x, sc)  # [BLOCK_N]
            acc = tl.where((rows == t)[:, None], acc + y[None, :], acc)
    y_ptr = Y + rows[:, None] * stride_yt + n[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=(rows < T)[:, None] & n_ok[None, :])


def fp8_gemv_config(N: int, K: int) -> dict:
    """Two rows a program (gemv.py's choice for bf16) and up to 4096 columns a trip (4 KB of each row: as many
    bytes in flight a row as gemv.py's 2048 bf16 columns), 2 warps. kernels_bench --only fp8_linear sweeps it."""
    return dict(BLOCK_N=2, BLOCK_K=min(triton.next_power_of_2(max(K, BLOCK)), 4096), num_warps=2)


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
    BLOCK_N, BLOCK_K (a multiple of 128), num_warps. pdl: KernelConfig.pdl."""
    T, K = x.shape
    N = w.shape[0]
    cfg = fp8_gemv_config(N, K)
    bad = [k for k in config or {} if k not in cfg]
    if bad:
        raise ValueError(f"fp8_gemv config keys {bad} are not among {list(cfg)}")
    cfg.update(config or {})
    if cfg["BLOCK_K"] % BLOCK or cfg["BLOCK_K"] & (cfg["BLOCK_K"] - 1):
        raise ValueError(f"fp8_gemv BLOCK_K={cfg['BLOCK_K']} must be a power of 2 and a multiple of {BLOCK}")
    _fp8_gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
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
        BLOCK_T=triton.next_power_of_2(T),
        BLOCK_N=cfg["BLOCK_N"],
        GROUPS=cfg["BLOCK_K"] // BLOCK,
        GROUP=BLOCK,
        num_warps=cfg["num_warps"],
        **pdl_args(x, pdl),
    )
    return out
