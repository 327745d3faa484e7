"""Fused MoE experts with 128x128 block-scaled FP8 weights (DeepSeek-V3/R1, Kimi-K2): fused_moe.py's pipeline on
fp8 weights. No host sync; buffers sized from shapes only (CUDA-graph safe).

- Few (token, k) pairs (<= KernelConfig.no_align_max_pairs: decode, verify): fp8_moe_gemv.py's grouped GEMVs (W8A16).
- Otherwise moe_align's per-expert blocks and two grouped tiled GEMMs (fp8_gemm.py's scaled K steps):
  GEMM1 = x . [gate | up]^T with SiLU(gate) * up fused, GEMM2 = h . down^T with the top-k weight fused, then
  moe_sum (plus `add`, the shared experts' output). Two forms:
  - A16 (W8A16): bf16 x and h, fp8 weight tiles widened in registers; for few rows per expert (weight streams).
  - A8 (W8A8, DeepSeek's recipe): x quantized per token per 128 channels once (fp8_quant.py), and GEMM1's
    epilogue quantizes h the same way (its BLOCK_N is one 128-channel group), so both GEMMs are fp8 x fp8 MMAs;
    for many rows per expert (prefill), where the MMAs are the cost.
The w13 scale rows follow fp8_reference's split layout: gate row n uses scale row n // 128, up row n uses
ceil(I/128) + n // 128.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..kernel_config import KernelConfig
from .fp8_moe_gemm import _fp8_moe_gemm1_kernel, _fp8_moe_gemm2_kernel
from .fp8_moe_gemv import fp8_moe_gemv
from .fp8_quant import act_quant
from .fp8_reference import BLOCK
from .moe_align import moe_align
from .moe_config import FP8_ROW_BANDS, KEYS, moe_config
from .moe_sum import moe_sum
from .pdl import pdl_args


def fp8_moe_config(
    T: int, K: int, E: int, D: int, I: int, a8: bool, dtype: torch.dtype = torch.bfloat16, **override
) -> tuple[dict, dict]:
    """(gemm1, gemm2) tiles from the expected rows per expert, with 128-column K steps (one scale block):
    - <= 16 rows (weight streams): moe_config's 16-row tiles, whose BLOCK_N shrinks until the active experts'
      tiles cover the SMs; 4 stages (fp8 tiles are half the bytes).
    - <= 32: 32x64 tiles, 4 warps.
    - more: 64x128 tiles, GEMM1 on 8 warps (its gate and up accumulators, with each K step's scaled product, need
      the registers: compile_check, sm_90: 64x128 on 4 warps or 128x128 on 8 spill 0.9-1.3 KB), GEMM2 on 4; GROUP_M
      8 (vLLM's untuned default for block-FP8 experts is 64x128x128 too). W8A8: GEMM1 64x64 on 4 warps, h
      quantized after it (3 programs an SM where 64x128 on 8 warps fit one; docs/experiments.md).
    A8: GEMM1's BLOCK_N one 128-channel group (its epilogue quantizes h per group), or a divisor of one (h written
    in x's dtype, then quantized by act_quant: fp8_fused_experts_ref's h_dtype). fp32 A16 (tests):
    IEEE FMA dots on 32x32 tiles (larger ones spill). `override` as moe_config's: flat keys, then gemm1={...} /
    gemm2={...}; a BLOCK_M given anywhere applies to both."""
    o1, o2 = dict(override.pop("gemm1", None) or {}), dict(override.pop("gemm2", None) or {})
    for where, o in (("", override), ("gemm1.", o1), ("gemm2.", o2)):
        bad = [k for k in o if k not in KEYS]
        if bad:
            raise ValueError(f"fp8 moe config keys {[where + k for k in bad]} are not among {KEYS}")
    rows = T * K / E
    if rows <= FP8_ROW_BANDS[0]:
        c1, c2 = moe_config(T, K, E, D, I, torch.bfloat16)
        for c in (c1, c2):
            c.update(BLOCK_K=BLOCK, num_stages=4)
    elif rows <= FP8_ROW_BANDS[1]:
        c1 = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=BLOCK, GROUP_M=1, num_warps=4, num_stages=4)
        c2 = dict(c1)
    else:
        c1 = dict(BLOCK_M=64, BLOCK_N=BLOCK, BLOCK_K=BLOCK, GROUP_M=8, num_warps=8, num_stages=3)
        c2 = dict(c1, num_warps=4)
    if a8:  # 64-row blocks: 64 h columns on 4 warps, h quantized after GEMM1 (3 programs an SM, not 1)
        c1["BLOCK_N"] = 64 if c1["BLOCK_M"] >= 64 else BLOCK
        if c1["BLOCK_M"] >= 64:
            c1["num_warps"] = 4
    elif dtype == torch.float32:
        for c in (c1, c2):
            c.update(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    c1.update(override, **o1)
    c2.update(override, **o2)
    bm = o1.get("BLOCK_M", o2.get("BLOCK_M", override.get("BLOCK_M")))
    if bm is not None:
        c1["BLOCK_M"] = c2["BLOCK_M"] = bm
    for name, c in (("gemm1", c1), ("gemm2", c2)):
        if BLOCK % c["BLOCK_K"] or c["BLOCK_K"] < 16:
            raise ValueError(f"fp8 moe {name}.BLOCK_K={c['BLOCK_K']} must be a power of 2 in [16, {BLOCK}]")
    if a8 and (BLOCK % c1["BLOCK_N"] or c1["BLOCK_N"] < 16):
        raise ValueError(f"fp8 moe A8: gemm1.BLOCK_N must divide {BLOCK} (h's groups), got {c1['BLOCK_N']}")
    return c1, c2


def moe_form(
    T: int,
    K: int,
    E: int,
    config=None,
    no_align_max_pairs: int = KernelConfig.no_align_max_pairs,
    dtype: torch.dtype = torch.bfloat16,
    a8_above: int = KernelConfig.fp8_a8_min_tokens,
) -> tuple[bool, bool, bool]:
    """-> (no_align, gemv, a8): fp8_fused_experts' form for T tokens of top-K over E local experts with x in `dtype`
    (config's "no_align" / "gemv" / "a8", else the defaults: per-pair blocks up to no_align_max_pairs pairs; fp32 x
    is never W8A8 unless forced, as in fp8_linear.linear_form)."""
    cfg = config or {}
    no_align = bool(cfg.get("no_align", T * K <= no_align_max_pairs))
    gemv = cfg.get("gemv", no_align)
    a8_default = T > a8_above and dtype != torch.float32  # in tokens, as the linears (KernelConfig says why)
    a8 = not gemv and bool(cfg.get("a8", a8_default))
    return no_align, gemv, a8


def tma_form(x: torch.Tensor, D: int, I: int, c1: dict, c2: dict, kernels: KernelConfig, weights=()) -> bool:
    """The W8A8 GEMMs read whole tiles by TMA (kernels.fp8_moe_tma, sm_90+): x quantized in the blocks' row order,
    h as GEMM1 writes it, the weights as [E * rows, K] tiles. Needs I and D to be whole tiles (a tile must not
    reach the next expert's rows: GEMM1's h scales are maxima over its columns), 16-byte rows, and `weights`
    (w13, w2) contiguous and 16-byte aligned."""
    if not (kernels.fp8_moe_tma and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9):
        return False
    return tma_fits(D, I, c1, c2) and all(w.is_contiguous() and w.data_ptr() % 16 == 0 for w in weights)


def tma_fits(D: int, I: int, c1: dict, c2: dict) -> bool:
    """Whole tiles, and each tile's columns inside one 128-row weight-scale block (the K loops read one scale a
    step)."""
    whole = I % c1["BLOCK_N"] == 0 and D % c2["BLOCK_N"] == 0 and D % 16 == 0 and I % 16 == 0
    return whole and BLOCK % c1["BLOCK_N"] == 0 and BLOCK % c2["BLOCK_N"] == 0


def _check(x, w13, s13, w2, s2, topk_weights, topk_ids):
    T, D = x.shape
    E, I2, D1 = w13.shape
    I = I2 // 2
    if D1 != D or I2 != 2 * I or w2.shape != (E, D, I):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} must be [E, 2I, {D}] / [E, {D}, I]")
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w13 and w2 must be float8_e4m3fn, got {w13.dtype} / {w2.dtype}")
    gi, gd = -(-I // BLOCK), -(-D // BLOCK)
    if s13.shape != (E, 2 * gi, gd) or s2.shape != (E, gd, gi) or s13.dtype != torch.float32 or s2.dtype != s13.dtype:
        raise ValueError(
            f"w13_scale_inv / w2_scale_inv must be fp32 [{E}, {2 * gi}, {gd}] / [{E}, {gd}, {gi}] (128x128 blocks; "
            f"w13's gate and up halves each ceil(I/128) rows), got {s13.dtype} {list(s13.shape)} / "
            f"{s2.dtype} {list(s2.shape)}"
        )
    K = topk_ids.shape[-1]
    if topk_ids.shape != (T, K) or topk_weights.shape != (T, K) or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"topk_ids/topk_weights must be [{T}, K] (weights fp32), got {tuple(topk_ids.shape)} "
            f"{tuple(topk_weights.shape)} {topk_weights.dtype}"
        )
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("x, w13 and w2 need a unit stride in their last dim")


def fp8_fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    *,
    add: torch.Tensor | None = None,
    norm: tuple | None = None,
    all_local: bool = True,
    config: dict | None = None,
    kernels: KernelConfig = KernelConfig(),
    plan_tokens: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """sum_k w[t,k] * down_e(silu(gate_e(x[t])) * up_e(x[t])) over the pairs whose expert e - expert_offset is in
    [0, E) (others contribute nothing: EP, the caller all-reduces), plus `add` [T, D] -> [T, D] in x.dtype; with
    norm = (weight [D], eps, residual [T, D]) the add + RMSNorm after the MoE fused into the sum (one rank):
    -> (norm(out + residual), out + residual), as moe_sum.
    x [T, D]; w13 e4m3 [E, 2I, D] (gate rows, then up rows) with w13_scale_inv fp32 [E, 2*ceil(I/128),
    ceil(D/128)]; w2 e4m3 [E, D, I] with w2_scale_inv [E, ceil(D/128), ceil(I/128)]; topk_weights [T, K] fp32;
    topk_ids [T, K] int. Equals fp8_reference.fp8_fused_experts_ref(a8=False) (GEMV and A16 forms) or (a8=True).
    all_local: every id names a local expert (the sum reads no ids). config (benchmarks, tests): fp8_moe_config
    overrides (flat, "gemm1", "gemm2"), "no_align" (default T*K <= kernels.no_align_max_pairs), "gemv" (default:
    no_align; moe GEMV tiles as a dict), "a8" (default: more than kernels.fp8_a8_min_tokens tokens), "tma" (the
    W8A8 GEMMs' TMA form, tma_form; default: on sm_90+ where the shapes fit).
    kernels: pdl, no_align_max_pairs, fp8_a8_min_tokens and fp8_moe_tma (kernel_config.py). plan_tokens: form and
    tiles are chosen for max(T, plan_tokens) tokens (an eager step planned as its padded CUDA-graph twin)."""
    _check(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids)
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    K = topk_ids.shape[-1]
    if T == 0:  # checks `add`; empty
        return moe_sum(x.new_empty(0, D), topk_ids, expert_offset, E, add, norm, all_local, kernels.pdl)
    TK, P = T * K, max(T, plan_tokens)
    no_align, gemv, a8 = moe_form(P, K, E, config, kernels.no_align_max_pairs, x.dtype, kernels.fp8_a8_min_tokens)
    cfg_tma = (config or {}).get("tma")
    config = {k: v for k, v in (config or {}).items() if k not in ("no_align", "gemv", "a8", "tma")}
    launch = pdl_args(x, kernels.pdl)
    y = torch.empty(TK, D, dtype=x.dtype, device=x.device)
    if gemv:
        if not no_align:
            raise ValueError(f"gemv: the GEMV form serves per-pair blocks only (no_align; T*K={TK})")
        hbuf = torch.empty(TK, I, dtype=x.dtype, device=x.device)
        gcfg = gemv if isinstance(gemv, dict) else None
        args = (x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, expert_offset)
        fp8_moe_gemv(*args, hbuf, y, launch, gcfg)
        return moe_sum(y, topk_ids, expert_offset, E, add, norm, all_local, kernels.pdl)
    c1, c2 = fp8_moe_config(P, K, E, D, I, a8, x.dtype, **config)
    bm = c1["BLOCK_M"]
    ids = topk_ids.reshape(-1)
    if no_align:  # block m = pair m alone; the align buffers are unused (any pointer will do)
        sorted_ids = expert_ids = num_padded = ids
        rows, num_m = TK, TK
    else:
        sorted_ids, expert_ids, num_padded = moe_align(topk_ids, E, expert_offset, bm, pdl=kernels.pdl)
        rows, num_m = sorted_ids.shape[0], expert_ids.shape[0]
    gi = -(-I // BLOCK)
    tma = (
        a8 and not no_align and bool(cfg_tma if cfg_tma is not None else tma_form(x, D, I, c1, c2, kernels, (w13, w2)))
    )
    if tma and not tma_fits(D, I, c1, c2):
        raise ValueError(
            f"tma: the TMA form needs I={I} and D={D} to be whole tiles of 16-byte rows, the tiles' BLOCK_N "
            f"({c1['BLOCK_N']}, {c2['BLOCK_N']}) dividing {BLOCK}"
        )
    # GEMM1 columns narrower than an h group (A8): h written in x's dtype, then quantized by act_quant, as
    # DeepSeek's and vLLM's W8A8 MoE round it; else GEMM1's epilogue quantizes its own group of h
    h16 = a8 and c1["BLOCK_N"] != BLOCK
    if a8:  # the TMA form quantizes x straight into the blocks' row order, so that GEMM1 reads whole tiles of it
        pairs = (sorted_ids, num_padded, K) if tma else None
        a, a_s = act_quant(x, BLOCK, pdl=kernels.pdl, sorted_pairs=pairs)  # [T or rows, D] e4m3, [., G] scales
        h = torch.empty(rows, I, dtype=x.dtype if h16 else torch.float8_e4m3fn, device=x.device)
        h_s = h if h16 else torch.empty(rows, gi, dtype=torch.float32, device=x.device)  # h16: h_s unused
    else:
        a, a_s = x, w13_scale_inv[0]  # a_s unused
        h = torch.empty(rows, I, dtype=x.dtype, device=x.device)
        h_s = h  # unused
    ad1 = wd1 = None  # None arguments are constexpr: the pointer kernels have no descriptors
    if tma:
        ad1 = TensorDescriptor.from_tensor(a, [bm, c1["BLOCK_K"]])
        wd1 = TensorDescriptor.from_tensor(w13.view(-1, D), [c1["BLOCK_N"], c1["BLOCK_K"]])
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(TK=TK, expert_offset=expert_offset, E_LOCAL=E, A8=a8, NO_ALIGN=no_align, DOT_PREC=prec, GROUP=BLOCK)
    _fp8_moe_gemm1_kernel[(num_m * triton.cdiv(I, c1["BLOCK_N"]),)](
        a,
        a_s,
        w13,
        w13_scale_inv,
        h,
        h_s,
        sorted_ids,
        expert_ids,
        num_padded,
        ids,
        ad1,
        wd1,
        I,
        D,
        num_m,
        a.stride(0),
        a_s.stride(0),
        a_s.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13_scale_inv.stride(0),
        w13_scale_inv.stride(1),
        w13_scale_inv.stride(2),
        h.stride(0),
        h_s.stride(0),
        TOPK=K,
        BLOCK_M=bm,
        BLOCK_N=c1["BLOCK_N"],
        BLOCK_K=c1["BLOCK_K"],
        GROUP_M=c1["GROUP_M"],
        num_warps=c1["num_warps"],
        num_stages=c1["num_stages"],
        TMA=tma,
        H16=h16,
        **common,
        **launch,
    )
    if h16:  # rows past num_padded hold garbage, quantized too: GEMM2 reads no block there
        h, h_s = act_quant(h, BLOCK, pdl=kernels.pdl)
        h_s = h_s.contiguous()  # [rows, G] row-major, as GEMM2 reads GEMM1's
    ad2 = wd2 = None
    if tma:
        ad2 = TensorDescriptor.from_tensor(h, [bm, c2["BLOCK_K"]])
        wd2 = TensorDescriptor.from_tensor(w2.view(-1, I), [c2["BLOCK_N"], c2["BLOCK_K"]])
    _fp8_moe_gemm2_kernel[(num_m * triton.cdiv(D, c2["BLOCK_N"]),)](
        h,
        h_s,
        w2,
        w2_scale_inv,
        y,
        sorted_ids,
        expert_ids,
        num_padded,
        topk_weights.reshape(-1),
        ids,
        ad2,
        wd2,
        D,
        I,
        num_m,
        h.stride(0),
        h_s.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale_inv.stride(0),
        w2_scale_inv.stride(1),
        w2_scale_inv.stride(2),
        y.stride(0),
        BLOCK_M=bm,
        BLOCK_N=c2["BLOCK_N"],
        BLOCK_K=c2["BLOCK_K"],
        GROUP_M=c2["GROUP_M"],
        num_warps=c2["num_warps"],
        num_stages=c2["num_stages"],
        TMA=tma,
        **common,
        **launch,
    )
    return moe_sum(y, topk_ids, expert_offset, E, add, norm, all_local, kernels.pdl)
