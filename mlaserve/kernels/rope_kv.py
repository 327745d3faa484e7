"""RoPE over interleaved pairs fused with the latent KV-cache write, the query RoPE (layers.rotary.apply_rope), and
the step's cos/sin tables (layers.rotary.RotaryEmbedding); and the rotate-half RoPE of the Llama EAGLE3 draft's
queries and keys (layers.rotary_llama.apply_rope_neox).

out[2i] = x[2i] cos[i] - x[2i+1] sin[i];  out[2i+1] = x[2i+1] cos[i] + x[2i] sin[i], computed in fp32 (rotate-half:
the pairs are (x[i], x[i + P/2])).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_release, pdl_start, pdl_wait
from .rmsnorm import _launch_args as _norm_launch_args


@triton.jit
def _rotate_pairs(x0, x1, cs, sn):
    """The rotation of every RoPE here (fp32 in, fp32 out): (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)."""
    return x0 * cs - x1 * sn, x1 * cs + x0 * sn


@triton.jit
def _kv_norm_weight(NormW, R: tl.constexpr, BLOCK_R: tl.constexpr, NORM: tl.constexpr):
    """kv_a_layernorm's weight row for _store_kv_row (0.0 without NORM): a weight, so loaded before the PDL wait."""
    if NORM:
        r = tl.arange(0, BLOCK_R)
        return tl.load(NormW + r, mask=r < R, other=0.0)
    else:
        return 0.0


@triton.jit
def _store_kv_row(
    Cache,
    Ckv,
    Kpe,
    Cos,
    Sin,
    norm_w,
    eps,
    t,
    slot,
    stride_cp,
    stride_cs,
    stride_ct,
    stride_cr,
    stride_kt,
    stride_kp,
    stride_cos,
    stride_sin,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NORM: tl.constexpr,
    kv_scale=1.0,
    FP8: tl.constexpr = False,
):
    """Token t's cache row at slot (>= 0): [c_kv, or kv_a_layernorm(c_kv) with NORM | rope(k_pe)]; norm_w: the
    norm's weight (_kv_norm_weight). FP8 (an e4m3 cache, attention/kv_fp8.py): the row as c_kv's and k_pe's dtype
    holds it, divided by kv_scale (the layer's, fp32), saturated and rounded to nearest even. Reads the step's
    activations: call it after pdl_wait. Every load comes before the first store (a store may alias a later load, so
    a load after it waits for it: one more round trip). Shared by rope_store_kv and head_gemv.absorb_q_rope_store_kv."""
    dst = Cache + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs
    r = tl.arange(0, BLOCK_R)
    c = tl.load(Ckv + t.to(tl.int64) * stride_ct + r * stride_cr, mask=r < R, other=0.0)
    i = tl.arange(0, BLOCK_HALF)
    ok = i < HALF
    src = Kpe + t.to(tl.int64) * stride_kt
    x0 = tl.load(src + (2 * i) * stride_kp, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(src + (2 * i + 1) * stride_kp, mask=ok, other=0.0).to(tl.float32)
    cs = tl.load(Cos + t.to(tl.int64) * stride_cos + i, mask=ok, other=0.0)
    sn = tl.load(Sin + t.to(tl.int64) * stride_sin + i, mask=ok, other=0.0)
    if NORM:  # kv_a_layernorm first, with layers.norm.RMSNorm's rounding (cast before the weight)
        cf = c.to(tl.float32)
        y = (cf * tl.rsqrt(tl.sum(cf * cf, axis=0) / R + eps)).to(Ckv.dtype.element_ty)
        c = (norm_w.to(tl.float32) * y.to(tl.float32)).to(Ckv.dtype.element_ty)
    if FP8:
        tl.store(dst + r, _to_fp8(c.to(Ckv.dtype.element_ty), kv_scale, Cache), mask=r < R)
        y0, y1 = _rotate_pairs(x0, x1, cs, sn)
        tl.store(dst + R + 2 * i, _to_fp8(y0.to(Kpe.dtype.element_ty), kv_scale, Cache), mask=ok)
        tl.store(dst + R + 2 * i + 1, _to_fp8(y1.to(Kpe.dtype.element_ty), kv_scale, Cache), mask=ok)
    else:
        tl.store(dst + r, c.to(Cache.dtype.element_ty), mask=r < R)
        y0, y1 = _rotate_pairs(x0, x1, cs, sn)
        tl.store(dst + R + 2 * i, y0.to(Cache.dtype.element_ty), mask=ok)
        tl.store(dst + R + 2 * i + 1, y1.to(Cache.dtype.element_ty), mask=ok)


@triton.jit
def _to_fp8(x, kv_scale, Cache):
    """attention.kv_fp8.quantize_kv: x / kv_scale in fp32 (div_rn: rounded as torch's division, where `/` would be
    the approximate div.full), saturated to e4m3's +-448, rounded to nearest even in the cache's fp8."""
    y = tl.math.div_rn(x.to(tl.float32), kv_scale)
    return tl.minimum(tl.maximum(y, -448.0), 448.0).to(Cache.dtype.element_ty)


@triton.jit
def _rope_store_kv_kernel(
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
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NORM: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_release(PDL)
    t = tl.program_id(0)
    slot = tl.load(Slots + t)  # a step input (copied from the host before the forward): read before the wait
    if slot < 0:  # padding token (CUDA graphs): no slot
        return
    norm_w = _kv_norm_weight(NormW, R, BLOCK_R, NORM)
    if FP8:
        kv_scale = tl.load(KvScale)  # written by no kernel of the step: before the wait
    else:
        kv_scale = 1.0
    pdl_wait(PDL)
    _store_kv_row(
        Cache,
        Ckv,
        Kpe,
        Cos,
        Sin,
        norm_w,
        eps,
        t,
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
        BLOCK_R,
        HALF,
        BLOCK_HALF,
        PAGE_SIZE,
        NORM,
        kv_scale,
        FP8,
    )


@triton.jit
def _rope_q_tile(
    X,
    Cos,
    Sin,
    Out,
    t,
    h,
    T,
    H,
    stride_xt,
    stride_xh,
    stride_xp,
    stride_ot,
    stride_oh,
    stride_op,
    stride_cos,
    stride_sin,
    P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """The query RoPE of tokens t [BLOCK_T] x heads h [BLOCK_H] (masked to < T, < H): a [BLOCK_T, BLOCK_H, P] tile
    of whole rows of P (vector loads), cos/sin read once per token. Shared by rope_q and head_gemv.absorb_q_rope.
    Every pair is read and written by the same program, so out may alias x."""
    p = tl.arange(0, BLOCK_P)
    t64 = t.to(tl.int64)
    ok = (t < T)[:, None, None] & (h < H)[None, :, None] & (p < P)[None, None, :]
    x = tl.load(
        X + t64[:, None, None] * stride_xt + h[None, :, None] * stride_xh + p[None, None, :] * stride_xp,
        mask=ok,
        other=0.0,
    ).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, BLOCK_P // 2, 2)))  # even, odd elements
    i = tl.arange(0, BLOCK_P // 2)
    cs_ok = (t < T)[:, None] & (i < P // 2)[None, :]
    cs = tl.load(Cos + t64[:, None] * stride_cos + i[None, :], mask=cs_ok, other=0.0)[:, None, :]
    sn = tl.load(Sin + t64[:, None] * stride_sin + i[None, :], mask=cs_ok, other=0.0)[:, None, :]
    y0, y1 = _rotate_pairs(x0, x1, cs, sn)
    y = tl.reshape(tl.join(y0, y1), (BLOCK_T, BLOCK_H, BLOCK_P))
    tl.store(
        Out + t64[:, None, None] * stride_ot + h[None, :, None] * stride_oh + p[None, None, :] * stride_op,
        y.to(Out.dtype.element_ty),
        mask=ok,
    )


@triton.jit
def _rope_q_kernel(
    X,
    Cos,
    Sin,
    Out,
    T,
    H,
    stride_xt,
    stride_xh,
    stride_xp,
    stride_ot,
    stride_oh,
    stride_op,
    stride_cos,
    stride_sin,
    P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _rope_q_tile(
        X,
        Cos,
        Sin,
        Out,
        t,
        h,
        T,
        H,
        stride_xt,
        stride_xh,
        stride_xp,
        stride_ot,
        stride_oh,
        stride_op,
        stride_cos,
        stride_sin,
        P,
        BLOCK_T,
        BLOCK_H,
        BLOCK_P,
    )


@triton.jit
def _rope_neox_kernel(
    X,
    Cos,
    Sin,
    Out,
    T,
    H,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """rope_neox: tokens [BLOCK_T] x heads [BLOCK_H] a program, each row's two halves (x1 = x[:HALF], x2 =
    x[HALF:]) rotated as (x1 cos - x2 sin, x2 cos + x1 sin) in fp32. Every element is read and written by the
    same program, so out may alias x."""
    pdl_start(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    t64 = t.to(tl.int64)
    ok = (t < T)[:, None, None] & (h < H)[None, :, None] & (i < HALF)[None, None, :]
    src = X + t64[:, None, None] * stride_xt + h[None, :, None] * stride_xh + i[None, None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    cs_ok = (t < T)[:, None] & (i < HALF)[None, :]
    cs = tl.load(Cos + t64[:, None] * stride_cos + i[None, :], mask=cs_ok, other=0.0)[:, None, :]
    sn = tl.load(Sin + t64[:, None] * stride_sin + i[None, :], mask=cs_ok, other=0.0)[:, None, :]
    y1, y2 = _rotate_pairs(x1, x2, cs, sn)
    dst = Out + t64[:, None, None] * stride_ot + h[None, :, None] * stride_oh + i[None, None, :]
    tl.store(dst, y1.to(Out.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, y2.to(Out.dtype.element_ty), mask=ok)


def rope_neox(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, pdl: bool = True
) -> torch.Tensor:
    """Llama's rotate-half RoPE (layers.rotary_llama.apply_rope_neox) in one launch: x [T, H, P] -> out [T, H, P],
    any token and head strides with a unit last one (out may be x itself); cos/sin [T, P/2] fp32."""
    T, H, P = x.shape
    if out.shape != x.shape or P % 2 or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(
            f"out {tuple(out.shape)} must match x {tuple(x.shape)}, with an even last dim and unit last strides"
        )
    _check_cos_sin(cos, sin, T, P)
    if T == 0:
        return out
    block_half = triton.next_power_of_2(P // 2)
    block_h, block_t, grid = _rope_tiles(T, H, 2 * block_half)
    _rope_neox_kernel[grid](
        x,
        cos,
        sin,
        out,
        T,
        H,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=P // 2,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
        **pdl_args(x, pdl),
    )
    return out


def _rope_tiles(T: int, H: int, block_p: int) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_H, BLOCK_T, grid) of the query RoPEs: ~4k elements a program of block_p-wide rows (not from T: one
    compile per H, P)."""
    block_h = min(triton.next_power_of_2(H), max(1, 4096 // block_p))
    block_t = max(1, 4096 // (block_h * block_p))
    return block_h, block_t, (triton.cdiv(T, block_t), triton.cdiv(H, block_h))


def _check_cos_sin(cos: torch.Tensor, sin: torch.Tensor, T: int, P: int) -> None:
    if cos.shape != (T, P // 2) or sin.shape != (T, P // 2) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos/sin must be fp32 [{T}, {P // 2}], got {tuple(cos.shape)} {cos.dtype}")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("cos/sin need a unit last stride")


def _check_store_kv(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor | None,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """rope_store_kv's inputs (also head_gemv.absorb_q_rope_store_kv's)."""
    if (kv_cache.dtype == torch.float8_e4m3fn) != (kv_scale is not None):
        raise ValueError(f"kv_scale: a float8_e4m3fn cache needs one (fp32, 1 element), a {kv_cache.dtype} none")
    if kv_scale is not None and (kv_scale.numel() != 1 or kv_scale.dtype != torch.float32):
        raise ValueError(f"kv_scale must be 1 fp32 element, got {tuple(kv_scale.shape)} {kv_scale.dtype}")
    if c_kv.dim() != 2:
        raise ValueError(f"c_kv {tuple(c_kv.shape)} must be [T, R]")
    T, R = c_kv.shape
    P = k_pe.shape[-1]
    if norm_weight is not None and (norm_weight.shape != (R,) or norm_weight.dtype != c_kv.dtype):
        raise ValueError(f"norm_weight must be [{R}] {c_kv.dtype}, got {tuple(norm_weight.shape)} {norm_weight.dtype}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != R + P or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [pages, page_size, {R + P}], unit last stride")
    if k_pe.shape != (T, P) or P % 2 or slot_mapping.shape != (T,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"k_pe [{T}, P even] and slot_mapping [{T}] int64 expected, got {tuple(k_pe.shape)} "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    _check_cos_sin(cos, sin, T, P)
    if kv_cache.shape[1] & (kv_cache.shape[1] - 1):
        raise ValueError(f"page_size={kv_cache.shape[1]} must be a power of two")


def rope_store_kv(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool = True,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """kv_cache [pages, page_size, R+P]; slot_mapping [T] int64 (page * page_size + offset; < 0 skips);
    c_kv [T, R], k_pe [T, P] (strided views allowed); cos/sin [T, P/2] fp32. Writes [c_kv | rope(k_pe)], or with
    norm_weight [R] (c_kv's dtype) [rms_norm(c_kv) | rope(k_pe)]: the kv_a_layernorm in the same launch.
    A float8_e4m3fn cache takes kv_scale (1 fp32 element, the layer's): the row is stored as attention.kv_fp8.
    quantize_kv stores it."""
    _check_store_kv(kv_cache, slot_mapping, c_kv, k_pe, cos, sin, norm_weight, kv_scale)
    T, R = c_kv.shape
    P, page_size = k_pe.shape[-1], kv_cache.shape[1]
    if T == 0:
        return
    _rope_store_kv_kernel[(T,)](
        kv_cache,
        slot_mapping,
        c_kv,
        k_pe,
        cos,
        sin,
        c_kv if norm_weight is None else norm_weight,
        c_kv if kv_scale is None else kv_scale,  # never read without FP8
        float(eps),
        kv_cache.stride(0),
        kv_cache.stride(1),
        c_kv.stride(0),
        c_kv.stride(1),
        k_pe.stride(0),
        k_pe.stride(1),
        cos.stride(0),
        sin.stride(0),
        R=R,
        BLOCK_R=triton.next_power_of_2(R),
        HALF=P // 2,
        BLOCK_HALF=triton.next_power_of_2(P // 2),
        # with the norm: rms_norm's warps, hence its reduction order, so the two paths round alike
        PAGE_SIZE=page_size,
        NORM=norm_weight is not None,
        FP8=kv_scale is not None,
        num_warps=(4 if R >= 256 else 1) if norm_weight is None else _norm_launch_args(R)["num_warps"],
        **pdl_args(c_kv, pdl),
    )


def rope_q(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """x [T, H, P] -> out [T, H, P] (any strides; out may be x itself)."""
    T, H, P = x.shape
    if out.shape != x.shape or P % 2:
        raise ValueError(f"out {tuple(out.shape)} must match x {tuple(x.shape)} with an even last dim")
    _check_cos_sin(cos, sin, T, P)
    if T == 0:
        return out
    block_p = max(2, triton.next_power_of_2(P))
    block_h, block_t, grid = _rope_tiles(T, H, block_p)
    _rope_q_kernel[grid](
        x,
        cos,
        sin,
        out,
        T,
        H,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        cos.stride(0),
        sin.stride(0),
        P=P,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_P=block_p,
        num_warps=4,
        **pdl_args(x, pdl),
    )
    return out


@triton.jit
def _cos_sin_kernel(
    Pos,
    InvFreq,
    Out,
    T,
    scale,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Out[0] = cos(pos * inv_freq) * scale, Out[1] = sin(...) * scale, [T, HALF] each: RotaryEmbedding's torch ops
    (int -> fp32, the product, CUDA's cosf/sinf as torch's kernels call them, the scale) in one launch."""
    pdl_start(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, BLOCK_HALF)
    ok = (t < T)[:, None] & (i < HALF)[None, :]
    inv_freq = tl.load(InvFreq + i, mask=i < HALF).to(tl.float32)
    f = tl.load(Pos + t, mask=t < T, other=0).to(tl.float32)[:, None] * inv_freq[None, :]
    c, s = tl.cos(f), tl.sin(f)  # on sm_90 libdevice's precise cosf/sinf (the same PTX as libdevice.cos)
    if SCALED:
        c, s = c * scale, s * scale
    out = t.to(tl.int64)[:, None] * HALF + i[None, :]
    tl.store(Out + out, c, mask=ok)
    tl.store(Out + T * HALF + out, s, mask=ok)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int, inv_freq [P/2] (fp32; another float dtype is widened, as torch promotes) -> (cos, sin)
    [T, P/2] fp32 each (views of one [2, T, P/2] buffer): cos(positions * inv_freq) * scale and sin(...) * scale,
    as layers.rotary computes them with torch ops (five launches there, one here)."""
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [T] int32/int64, got {tuple(positions.shape)} {positions.dtype}")
    if inv_freq.dim() != 1 or not inv_freq.is_floating_point() or not inv_freq.is_contiguous():
        raise ValueError(
            f"inv_freq must be a contiguous [P/2] float tensor, got {tuple(inv_freq.shape)} {inv_freq.dtype}"
        )
    T, half = positions.shape[0], inv_freq.shape[0]
    out = torch.empty(2, T, half, dtype=torch.float32, device=positions.device)
    if T:
        block_half = triton.next_power_of_2(half)
        block_t = max(1, min(triton.next_power_of_2(T), 2048 // block_half))
        _cos_sin_kernel[(triton.cdiv(T, block_t),)](
            positions.contiguous(),
            inv_freq,
            out,
            T,
            float(scale),
            HALF=half,
            BLOCK_T=block_t,
            BLOCK_HALF=block_half,
            SCALED=scale != 1.0,
            num_warps=4,
            **pdl_args(positions, pdl),
        )
    return out[0], out[1]
