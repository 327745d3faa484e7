"""y[t, h] = x[t, h] @ M[h] for a few tokens: MLA's absorbed projections in small decode steps, one Triton kernel.

The projection contract (docs/design.md) runs both absorptions as torch.bmm into strided views of caller-owned buffers.
At batch 1 cuBLAS takes 2.7-3.0 us for each 2 MB per-head weight (M1, H200: 0.7-0.8 TB/s, its 64x8 tiles mostly
idle); this kernel 1.2-1.3 us. Each program owns BLOCK_N output columns of one head and loads its whole
[K, BLOCK_N] slab of M[h] as one register tile, issued before it waits for x (pdl.py), then serves every token
of the step from it. The contract is kept: the output is written straight into the caller's view, with no copy
and no temporary. absorb_q_rope runs the query's absorption and its RoPE (rope_kv.rope_q's tile) in one launch;
absorb_q_rope_store_kv also the step's KV store (rope_kv.rope_store_kv's row), as one more program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_config import KernelConfig
from .pdl import pdl_args, pdl_release, pdl_wait
from .rope_kv import _check_cos_sin, _check_store_kv, _kv_norm_weight, _rope_q_tile, _store_kv_row

# tokens a launch serves: the sizes timed against bmm (kernels_bench absorb, T=1 and 2: batch 1-2 decode, or an EAGLE3
# verify of width 2 at batch 1); the kernel itself serves any T, larger steps keep torch.bmm until timed. Which
# steps come here is KernelConfig.head_gemv_max_tokens.
HEAD_GEMV_MAX_TOKENS = 2


@triton.jit
def _head_gemv_program(
    X,
    M,
    Y,
    h,
    col,
    stride_xt,
    stride_xh,
    stride_mh,
    stride_mk,
    stride_mn,
    stride_yt,
    stride_yh,
    T: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Output columns [col * BLOCK_N, +BLOCK_N) of head h for every token: the slab first, then the wait."""
    n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, K)
    m = tl.load(M + h.to(tl.int64) * stride_mh + k[:, None] * stride_mk + n[None, :] * stride_mn)  # [K, BLOCK_N]
    pdl_wait(PDL)
    for t in tl.static_range(T):
        x = tl.load(X + t * stride_xt + h * stride_xh + k)  # [K]
        y = tl.sum(m.to(tl.float32) * x.to(tl.float32)[:, None], axis=0)
        tl.store(Y + t * stride_yt + h * stride_yh + n, y.to(Y.dtype.element_ty))


@triton.jit
def _head_gemv_kernel(
    X,
    M,
    Y,
    stride_xt,
    stride_xh,
    stride_mh,
    stride_mk,
    stride_mn,
    stride_yt,
    stride_yh,
    T: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_release(PDL)
    _head_gemv_program(
        X,
        M,
        Y,
        tl.program_id(0),
        tl.program_id(1),
        stride_xt,
        stride_xh,
        stride_mh,
        stride_mk,
        stride_mn,
        stride_yt,
        stride_yh,
        T,
        K,
        BLOCK_N,
        PDL,
    )


@triton.jit
def _store_kv_program(
    Cache,
    Slots,
    Ckv,
    Kpe,
    Cos,
    Sin,
    NormW,
    KvScale,
    eps,
    stride_cp,
    stride_cs,
    stride_ct,
    stride_cr,
    stride_kt,
    stride_kp,
    stride_cos,
    stride_sin,
    T: tl.constexpr,
    BLOCK_T: tl.constexpr,
    R: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NORM: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """rope_store_kv for every token of the step in one program (T <= 2): the slots (step inputs), the norm's
    weight and an FP8 cache's scale before the wait."""
    tt = tl.arange(0, BLOCK_T)
    slots = tl.load(Slots + tt, mask=tt < T, other=-1)  # [BLOCK_T]
    norm_w = _kv_norm_weight(NormW, R, R, NORM)
    if FP8:
        kv_scale = tl.load(KvScale)
    else:
        kv_scale = 1.0
    pdl_wait(PDL)
    for t in tl.static_range(T):
        slot = tl.sum(tl.where(tt == t, slots, 0), axis=0)
        if slot >= 0:  # padding tokens (CUDA graphs, slot -1) have no slot
            _store_kv_row(
                Cache,
                Ckv,
                Kpe,
                Cos,
                Sin,
                norm_w,
                eps,
                tl.full((), t, tl.int32),
                slot,
                stride_cp,
                stride_cs,
                stride_ct,
                stride_cr,
                stride_kt,
                stride_kp,
                stride_cos,
                stride_sin,
                R,
                R,
                HALF,
                BLOCK_HALF,
                PAGE_SIZE,
                NORM,
                kv_scale,
                FP8,
            )


@triton.jit
def _absorb_q_rope_kernel(
    X,
    M,
    Y,
    Xpe,
    Cos,
    Sin,
    Ype,
    H,
    stride_xt,
    stride_xh,
    stride_mh,
    stride_mk,
    stride_mn,
    stride_yt,
    stride_yh,
    stride_cos,
    stride_sin,
    Cache,
    Slots,
    Ckv,
    Kpe,
    NormW,
    KvScale,
    eps,
    stride_cp,
    stride_cs,
    stride_ct,
    stride_cr,
    stride_kt,
    stride_kp,
    T: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    STORE: tl.constexpr,
    NORM: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (H + STORE, N / BLOCK_N + 1): for h < H, columns < N / BLOCK_N are head_gemv's programs and the last
    # one rotates the head's q_pe for every token with rope_q's tile (q and cos/sin are written in the step: read
    # only after the wait). With STORE, program (H, 0) writes the step's KV-cache rows (rope_store_kv's, with
    # N = R); the rest of row H returns at once.
    h = tl.program_id(0)
    col = tl.program_id(1)
    pdl_release(PDL)
    if h < H:
        if col < N // BLOCK_N:
            _head_gemv_program(
                X,
                M,
                Y,
                h,
                col,
                stride_xt,
                stride_xh,
                stride_mh,
                stride_mk,
                stride_mn,
                stride_yt,
                stride_yh,
                T,
                K,
                BLOCK_N,
                PDL,
            )
        else:
            pdl_wait(PDL)
            _rope_q_tile(
                Xpe,
                Cos,
                Sin,
                Ype,
                tl.arange(0, BLOCK_T),
                h + tl.arange(0, 1),
                T,
                H,
                stride_xt,
                stride_xh,
                1,
                stride_yt,
                stride_yh,
                1,
                stride_cos,
                stride_sin,
                P,
                BLOCK_T,
                1,
                BLOCK_P,
            )
    elif STORE:
        if col == 0:
            _store_kv_program(
                Cache,
                Slots,
                Ckv,
                Kpe,
                Cos,
                Sin,
                NormW,
                KvScale,
                eps,
                stride_cp,
                stride_cs,
                stride_ct,
                stride_cr,
                stride_kt,
                stride_kp,
                stride_cos,
                stride_sin,
                T,
                BLOCK_T,
                N,
                P // 2,
                BLOCK_P // 2,
                PAGE_SIZE,
                NORM,
                FP8,
                PDL,
            )


def head_gemv_config(K: int, N: int) -> dict:
    """H200, M1's 16 heads over 8 layers' weights (kernels_bench absorb, 2026-11-30), one warp a program:
    absorb_q (K=128, N=512) BLOCK_N 32: 1.28 us (16: 1.43, 64: 1.31; 2 warps 1.35, 4 warps 4.2) against bmm's 2.68;
    absorb_out (K=512, N=128) BLOCK_N 4: 1.16 us (2: 1.52, 8: 1.46, 16: 1.40) against bmm's 2.99.
    At T=2 the same tiles take 1.75 / 2.09 us against bmm's 2.65 / 2.99."""
    return dict(BLOCK_N=max(1, min(N, 32 if K <= 128 else 4)), num_warps=1)


def head_gemv_serves(x: torch.Tensor, m: torch.Tensor, max_tokens: int = KernelConfig.head_gemv_max_tokens) -> bool:
    """Whether the model's absorbed projections send x [T, H, K] @ m [H, K, N] here: a CUDA decode step of
    1..max_tokens tokens in bf16/fp16 with power-of-two K and N (all DeepSeek-V3-family heads: 128 and 512)."""
    T, _, K = x.shape
    N = m.shape[-1]
    return (
        x.is_cuda
        and 1 <= T <= max_tokens
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and not K & (K - 1)
        and not N & (N - 1)
    )


def _checked_config(x: torch.Tensor, m: torch.Tensor, out: torch.Tensor, config: dict | None) -> dict:
    T, H, K = x.shape
    N = m.shape[-1]
    if m.shape != (H, K, N) or out.shape != (T, H, N):
        raise ValueError(
            f"x {tuple(x.shape)}, m {tuple(m.shape)}, out {tuple(out.shape)}: need [T, H, K], [H, K, N], [T, H, N]"
        )
    if not 1 <= T <= HEAD_GEMV_MAX_TOKENS:
        raise ValueError(f"head_gemv serves 1..{HEAD_GEMV_MAX_TOKENS} tokens, got T={T}")
    if x.stride(-1) != 1 or out.stride(-1) != 1 or not (x.dtype == m.dtype == out.dtype):
        raise ValueError("x and out need a unit last stride, and x, m, out one dtype")
    cfg = dict(head_gemv_config(K, N), **(config or {}))
    bn = cfg["BLOCK_N"]
    if K & (K - 1) or N & (N - 1) or N % bn:
        raise ValueError(f"head_gemv needs power-of-two K={K}, N={N} and N divisible by BLOCK_N={bn}")
    return cfg


def head_gemv(
    x: torch.Tensor, m: torch.Tensor, out: torch.Tensor, config: dict | None = None, pdl: bool = True
) -> torch.Tensor:
    """x [T, H, K], m [H, K, N] (any strides), out [T, H, N] (unit last stride; a view is fine) -> out, written in
    place: out[t, h] = x[t, h] @ m[h] with fp32 sums (torch.bmm's result up to summation order). T <= 2;
    K and N powers of two, N divisible by BLOCK_N."""
    cfg = _checked_config(x, m, out, config)
    T, H, K = x.shape
    N, bn = m.shape[-1], cfg["BLOCK_N"]
    _head_gemv_kernel[(H, N // bn)](
        x,
        m,
        out,
        x.stride(0),
        x.stride(1),
        m.stride(0),
        m.stride(1),
        m.stride(2),
        out.stride(0),
        out.stride(1),
        T=T,
        K=K,
        N=N,
        BLOCK_N=bn,
        num_warps=cfg["num_warps"],
        **pdl_args(x, pdl),
    )
    return out


def absorb_q_rope(
    q: torch.Tensor,
    w_kc: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    Q: torch.Tensor,
    config: dict | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """q [T, H, N+P] (unit last stride; a view is fine), w_kc [H, N, R], cos/sin [T, P/2] fp32 -> Q [T, H, R+P]
    (unit last stride), written in place in one launch: Q[..., :R] = head_gemv(q[..., :N], w_kc) and
    Q[..., R:] = rope_q(q[..., N:], cos, sin), bit for bit what the two kernels give."""
    return _absorb_q_rope(q, w_kc, cos, sin, Q, config, None, pdl)


def absorb_q_rope_store_kv(
    q: torch.Tensor,
    w_kc: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    Q: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    config: dict | None = None,
    pdl: bool = True,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """absorb_q_rope and rope_store_kv(kv_cache, slot_mapping, c_kv, k_pe, cos, sin, norm_weight, eps,
    kv_scale=kv_scale) of one decode step in one launch: one more program writes the cache rows, so the store needs
    no kernel (or stream) of its own. Q is bit for bit absorb_q_rope's; the cache rows are rope_store_kv's, except
    that with the norm its sum of squares is reduced by one warp (rope_store_kv: rms_norm's warps), so they may
    differ in the last bit."""
    if c_kv.dim() != 2 or q.dim() != 3 or w_kc.dim() != 3 or c_kv.shape != (q.shape[0], w_kc.shape[-1]):
        raise ValueError(
            f"c_kv {tuple(c_kv.shape)} must be [T, R] for q {tuple(q.shape)} [T, H, N+P] and w_kc "
            f"{tuple(w_kc.shape)} [H, N, R]"
        )
    if k_pe.shape[-1] != q.shape[-1] - w_kc.shape[1]:
        raise ValueError(f"k_pe {tuple(k_pe.shape)} must be [T, P] with q's P = {q.shape[-1] - w_kc.shape[1]}")
    _check_store_kv(kv_cache, slot_mapping, c_kv, k_pe, cos, sin, norm_weight, kv_scale)
    store = (kv_cache, slot_mapping, c_kv, k_pe, norm_weight, eps, kv_scale)
    return _absorb_q_rope(q, w_kc, cos, sin, Q, config, store, pdl)


def _absorb_q_rope(q, w_kc, cos, sin, Q, config, store, pdl: bool) -> torch.Tensor:
    """The launch of both entry points; store: (kv_cache, slot_mapping, c_kv, k_pe, norm_weight, eps, kv_scale),
    checked."""
    if q.dim() != 3 or w_kc.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)} must be [T, H, N+P] and w_kc {tuple(w_kc.shape)} [H, N, R]")
    T, H, NP = q.shape
    N, R = w_kc.shape[-2:]
    P = NP - N
    if P <= 0 or P % 2 or Q.shape != (T, H, R + P):
        raise ValueError(
            f"q {tuple(q.shape)}, w_kc {tuple(w_kc.shape)}, Q {tuple(Q.shape)}: need [T, H, N+P], "
            f"[H, N, R], [T, H, R+P] with P > 0 even"
        )
    x, out = q[..., :N], Q[..., :R]
    cfg = _checked_config(x, w_kc, out, config)
    _check_cos_sin(cos, sin, T, P)
    bn = cfg["BLOCK_N"]
    if store is None:  # the store's arguments are never read: any tensor, zero strides
        cache, slots, c_kv, k_pe, norm_weight, eps, kv_scale = Q, Q, Q, Q, None, 0.0, None
        cache_strides, ckv_strides, kpe_strides = (0, 0), (0, 0), (0, 0)
    else:
        cache, slots, c_kv, k_pe, norm_weight, eps, kv_scale = store
        cache_strides, ckv_strides, kpe_strides = cache.stride()[:2], c_kv.stride(), k_pe.stride()
    _absorb_q_rope_kernel[(H + (store is not None), R // bn + 1)](
        x,
        w_kc,
        out,
        q[..., N:],
        cos,
        sin,
        Q[..., R:],
        H,
        q.stride(0),
        q.stride(1),
        w_kc.stride(0),
        w_kc.stride(1),
        w_kc.stride(2),
        Q.stride(0),
        Q.stride(1),
        cos.stride(0),
        sin.stride(0),
        cache,
        slots,
        c_kv,
        k_pe,
        c_kv if norm_weight is None else norm_weight,
        c_kv if kv_scale is None else kv_scale,  # never read without FP8
        float(eps),
        *cache_strides,
        *ckv_strides,
        *kpe_strides,
        T=T,
        K=N,
        N=R,
        BLOCK_N=bn,
        P=P,
        BLOCK_P=triton.next_power_of_2(P),
        BLOCK_T=triton.next_power_of_2(T),
        PAGE_SIZE=cache.shape[1] if store is not None else 1,
        STORE=store is not None,
        NORM=norm_weight is not None,
        FP8=kv_scale is not None,
        num_warps=cfg["num_warps"],
        **pdl_args(q, pdl),
    )
    return Q
