"""C = A @ dequant(W)^T with 128x128 block-scaled FP8 weights: a tiled Triton GEMM on tensor cores.

Each K step covers at most one 128-column scale block (BLOCK_K divides 128), so the step's product is scaled
once, in fp32, outside the MMA: acc += dot(a, w) * row_scale * col_scale (col_scale[n] = W's scale of column
block n // 128). That also promotes the fp8 MMA's partial sums to fp32 every 128 channels, as DeepGEMM does.
Two forms of A:
- A8 (W8A8): A is fp8_act_quant's e4m3 with per-row-per-128 scales (DeepSeek's recipe): fp8 x fp8 MMAs.
- A16 (W8A16): A is the bf16/fp16 activation, W's fp8 tile widened to it (exact) in registers.
SPLIT_K > 1 splits the K blocks over programs (few rows and few output tiles: the weight stream needs more
programs than the tiles give); the partial sums land in an fp32 workspace and _split_sum_kernel adds them in
split order into C (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_reference import BLOCK
from .fused_moe import _pid_to_tile
from .moe_config import SMS
from .pdl import pdl_args, pdl_start


@triton.jit
def scaled_step(acc, a, w, a_s, w_s, A8: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc [M, N] += (a [M, K] . w [K, N]) * a_s[:, None] * w_s[None, :] (A8), or * w_s (A16: w widened to a's
    dtype, a_s unused)."""
    if A8:
        return acc + tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
    return acc + tl.dot(a, w.to(a.dtype), input_precision=DOT_PREC) * w_s[None, :]


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    A,
    AS,
    W,
    WS,
    C,
    P,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_asm,
    stride_asg,
    stride_wn,
    stride_wsn,
    stride_wsg,
    stride_cm,
    A8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (tile, split s): the K blocks [s*per, (s+1)*per) of 128 columns, per = cdiv(cdiv(K, 128), SPLIT_K).
    SPLIT_K == 1: C[tile] in C's dtype; else P[s, tile] (fp32, [SPLIT_K, M, N] contiguous)."""
    pdl_start(PDL)
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    per = tl.cdiv(tl.cdiv(K, GROUP), SPLIT_K) * GROUP
    k_lo = tl.program_id(1) * per
    k_hi = tl.minimum(k_lo + per, K)
    a_ptr = A + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptr = W + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [K, N] view
    as_ptr = AS + offs_m.to(tl.int64) * stride_asm
    ws_ptr = WS + (offs_n // GROUP) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptr + k0 * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        w_s = tl.load(ws_ptr + (k0 // GROUP) * stride_wsg, mask=n_ok, other=0.0)
        a_s = w_s  # A16: unused
        if A8:
            a_s = tl.load(as_ptr + (k0 // GROUP) * stride_asg, mask=m_ok, other=0.0)
        acc = scaled_step(acc, a, w, a_s, w_s, A8, DOT_PREC)
    if SPLIT_K == 1:
        c_ptr = C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        p_ptr = P + (tl.program_id(1) * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(p_ptr, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _split_sum_kernel(P, C, M, N, stride_cm, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """C[m, n] = sum over s in order of P[s, m, n]; one program per (row, BLOCK columns)."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(P + (s * M + m) * N + n, mask=n < N, other=0.0)
    tl.store(C + m * stride_cm + n, acc.to(C.dtype.element_ty), mask=n < N)


def fp8_gemm_config(M: int, N: int, K: int, a8: bool, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tiles from the shape: few rows -> 16/32/64-row tiles streaming the weight (64 columns, split over K until
    the programs cover the SMs about twice); many rows -> 128x128x128 tiles, 8 warps, GROUP_M 8 (vLLM's H100 choice
    for block-FP8 GEMMs at large M). fp32 A16 (tests): IEEE FMA dots, small tiles (larger ones spill).
    kernels_bench --only fp8_linear sweeps around it."""
    if dtype == torch.float32 and not a8:
        cfg = dict(BLOCK_M=16 if M <= 16 else 32, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    elif M <= 64:
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        cfg = dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif M <= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3 if a8 else 2)
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    kb, split = triton.cdiv(K, BLOCK), 1
    while tiles * split * 2 <= 2 * SMS and kb // (split * 2) >= 4:  # >= 4 scale blocks (512 columns) a split
        split *= 2
    return dict(cfg, SPLIT_K=split)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    config: dict | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """out [M, N] (unit last stride) = a [M, K] @ dequant(w [N, K], w_scale)^T. a_scale given: a is e4m3 with
    scales [M, ceil(K/128)] (A8, any strides); None: a is bf16/fp16/fp32 (A16). The caller checked shapes.
    config: fp8_gemm_config's keys (BLOCK_K a power of 2 dividing 128). pdl: KernelConfig.pdl."""
    M, K = a.shape
    N = w.shape[0]
    a8 = a_scale is not None
    cfg = fp8_gemm_config(M, N, K, a8, a.dtype)
    bad = [k for k in config or {} if k not in cfg]
    if bad:
        raise ValueError(f"fp8_gemm config keys {bad} are not among {list(cfg)}")
    cfg.update(config or {})
    if BLOCK % cfg["BLOCK_K"] or cfg["BLOCK_K"] < 16:
        raise ValueError(f"fp8_gemm BLOCK_K={cfg['BLOCK_K']} must be a power of 2 in [16, {BLOCK}]")
    split = cfg["SPLIT_K"]
    part = torch.empty(split, M, N, dtype=torch.float32, device=a.device) if split > 1 else out
    sa = a_scale if a8 else w_scale  # A16: unused (any tensor)
    launch = pdl_args(a, pdl)
    _fp8_gemm_kernel[(triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), split)](
        a,
        sa,
        w,
        w_scale,
        out,
        part,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        sa.stride(0),
        sa.stride(1),
        w.stride(0),
        w_scale.stride(0),
        w_scale.stride(1),
        out.stride(0),
        A8=a8,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"],
        SPLIT_K=split,
        DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
        GROUP=BLOCK,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **launch,
    )
    if split > 1:
        blk = min(1024, triton.next_power_of_2(N))
        _split_sum_kernel[(M, triton.cdiv(N, blk))](
            part, out, M, N, out.stride(0), SPLIT_K=split, BLOCK=blk, num_warps=4, **launch
        )
    return out
