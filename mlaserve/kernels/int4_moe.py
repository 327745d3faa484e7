"""The fused MoE on INT4 experts (W4A16, compressed-tensors pack-quantized, group 32): the GEMV form for steps of few
(token, k) pairs (on the tensor cores, int4_mma_run.py, where it applies; else FMAs, int4_gemv.py), grouped tiled
GEMMs over moe_align's blocks for larger ones (int4_gemm.py), then the sum over k (moe_sum.py). No host
sync; buffers sized from shapes only (CUDA-graph safe).

Reference: tests/helpers/int4_ref.py, int4_fused_experts_ref (dequantize, then layers.moe.fused_experts_ref).
"""

from __future__ import annotations

import torch
import triton

from ..kernel_config import KernelConfig
from .int4_gemm import int4_gemm
from .int4_gemv import int4_gemv
from .int4_mma_run import int4_gemv_mma, mma_config, mma_preferred, mma_supported
from .moe_align import moe_align
from .moe_config import INT4_ROW_BANDS
from .moe_sum import moe_sum
from .pdl import pdl_args

FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def default_form(pairs: int, E: int, kernels: KernelConfig = KernelConfig(), num_experts: int = 0) -> str:
    """'gemv' or 'gemm' for `pairs` (token, k) pairs over E local experts of num_experts in all (0: E): the GEMV
    form while the pairs are at most kernels.int4_gemv_sharing x the distinct experts they are expected to select
    (pairs draws over n = num_experts or E: n (1 - (1 - 1/n)^pairs); under EP the pairs a rank owns and the experts
    they select are both the E / n share, so the ratio is judged over all n) and at most kernels.int4_gemv_max_pairs
    (at 384 experts ~610 pairs, decode of 76 requests; with 48 experts all local ~76 pairs)."""
    n = num_experts or E
    distinct = n * (1.0 - (1.0 - 1.0 / n) ** pairs)
    return "gemv" if pairs <= kernels.int4_gemv_max_pairs and pairs <= kernels.int4_gemv_sharing * distinct else "gemm"


def gemv_config(D: int, I: int, pairs: int) -> tuple[dict, dict]:
    """(gemv1, gemv2) tiles from the shape (compile_check for sm_90: registers, instructions per weight). Warps sit
    on rows and lanes on groups, so the x a thread unpacks serves all its rows; trips of G <= 32 groups (1024
    columns, 512 bytes a row).
    gemv1 (K = D): 16 gate rows (+ their up rows) a program, 95 registers (5 programs an SM, 16 KB of words in
    flight each), 3.3 instructions a weight; fewer rows while that leaves under 512 programs (MoE-TP4/TP8 at one
    token), then with each trip's loads issued before the previous trip's arithmetic (PREFETCH).
    gemv2 (K = I, one or two trips): 8 KB of words a program (16 rows of 1 KB at I=2048 ... 64 of 128 B at 256)."""
    ng1, ng2 = D // 32, I // 32
    g1 = min(32, triton.next_power_of_2(ng1))
    rows = 16
    while rows > 4 and pairs * triton.cdiv(I, rows) < 512:
        rows //= 2
    c1 = dict(ROWS=rows, G=g1, num_warps=4, PREFETCH=rows < 16 and ng1 > g1)
    g2 = min(32, triton.next_power_of_2(ng2))
    c2 = dict(ROWS=min(128, 512 // g2), G=g2, num_warps=4, PREFETCH=False)
    return c1, c2


def gemm_config(T: int, K: int, E: int, D: int, I: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """(gemm1, gemm2) tiles from the expected rows per expert T*K/E. Every block dequantizes its weight tiles anew
    (about 6 instructions a weight in all, the tile's pass through shared memory included), so blocks grow sooner
    than moe_config.py's: a block as large as the mean rows an expert (32, 64, then 128 rows) reads and unpacks
    each expert about once. BLOCK_K 64 (two scale groups) from 24 rows, 128 below. The GEMMs run transposed
    (TRANS: the dequantized weight rows as wgmma's register A operand, the block's rows as its N), 128 weight rows
    a program in the 64-row blocks, but for GEMM2 of the 128-row blocks: 128 x 128 untransposed tiles on 8 warps
    (benchmarks/int4_moe_tiles.py). Above 64 rows an expert the 128-row blocks take a TAIL: an expert's last rows,
    if at most 64, in a second list of 64-row blocks (the 64-row band's tiles)."""
    rows = T * K / E
    if dtype == torch.float32:  # tests: IEEE fp32 dots
        c = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
        return c, dict(c)
    if rows <= INT4_ROW_BANDS[0]:
        c1 = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, TRANS=True)
        return c1, dict(c1)
    if rows <= INT4_ROW_BANDS[1]:
        c1 = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3, TRANS=True)
        return c1, dict(c1)
    # an expert's last rows, if at most 64, in the 64-row tiles (moe_align's tail list): 171 rows compute 192.
    # GEMM2 (K = I, short) on 8 warps over 128 x 128 tiles, untransposed
    tail = dict(BLOCK_M=64, BLOCK_N=128)
    c1 = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3, TRANS=True, TAIL=tail)
    c2 = dict(c1, BLOCK_N=128, num_warps=8, TRANS=False, TAIL=dict(tail, num_warps=4, TRANS=True))
    return c1, c2


def _gemm_tiles(c1: dict, c2: dict) -> list[tuple[dict, dict]]:
    """[(gemm1, gemm2) tiles of the main list] + [those of the tail list] where c1 and c2 take a TAIL (changes to
    their tiles; BLOCK_M half the main's); errors name the key and the limit."""
    t1, t2 = c1.pop("TAIL", None), c2.pop("TAIL", None)
    if (t1 is None) != (t2 is None):
        raise ValueError("config: gemm1 and gemm2 take a TAIL together or not at all")
    tiles = [(c1, c2)] + ([(dict(c1, **t1), dict(c2, **t2))] if t1 is not None else [])
    for a, b in tiles:
        bm = a["BLOCK_M"]
        if b["BLOCK_M"] != bm or bm & (bm - 1) or bm < 16:
            raise ValueError(
                f"config: gemm1/gemm2 BLOCK_M {bm}/{b['BLOCK_M']} (TAIL: their tail's) must agree and be a power of "
                "2 >= 16"
            )
        for c in (a, b):
            if c["BLOCK_K"] % 32 or c["BLOCK_K"] & (c["BLOCK_K"] - 1):
                raise ValueError(f"config: BLOCK_K={c['BLOCK_K']} must be a power of 2 and a multiple of 32")
    if len(tiles) == 2 and tiles[1][0]["BLOCK_M"] * 2 != c1["BLOCK_M"]:
        raise ValueError(f"config: TAIL's BLOCK_M={tiles[1][0]['BLOCK_M']} must be half of BLOCK_M={c1['BLOCK_M']}")
    return tiles


def resolve_form(
    form: str, pairs: int, E: int, D: int, I: int, kernels: KernelConfig, mma_ok: bool, num_experts: int = 0
) -> str:
    """'gemv_mma' / 'gemv_fma' / 'gemm' for a config's form ('' or None: default_form's; 'gemv': on the tensor
    cores where mma_ok (mma_supported) and mma_preferred) at `pairs` (token, k) pairs over E local experts of
    num_experts in all (0: E)."""
    form = form or default_form(pairs, E, kernels, num_experts)
    if form == "gemv":
        form = "gemv_mma" if mma_ok and mma_preferred(D, I, pairs) else "gemv_fma"
    if form not in ("gemv_mma", "gemv_fma", "gemm"):
        raise ValueError(f"config: form={form!r} must be 'gemv', 'gemv_mma', 'gemv_fma' or 'gemm'")
    return form


def form_tiles(
    form: str, tokens: int, K: int, E: int, D: int, I: int, dtype: torch.dtype, kernels: KernelConfig,
    num_experts: int = 0,
) -> tuple[dict, dict]:  # fmt: skip
    """The default tiles of `form` for a step of `tokens` tokens of top-K over E local experts of num_experts in
    all (0: E; EP: the tensor-core GEMV's tiles follow the pairs the rank is expected to own, tokens x K x E /
    num_experts); in deterministic mode the GEMMs take kernels.int4_fixed_config() at every step (fp32 x:
    gemm_config's one fp32 tile), so a row's sums do not depend on the step."""
    fixed = kernels.int4_fixed_config()
    if form == "gemm" and fixed is not None and dtype != torch.float32:
        return dict(fixed), dict(fixed)
    if form == "gemm":
        return gemm_config(tokens, K, E, D, I, dtype)
    if form == "gemv_mma":
        return mma_config(D, I, tokens * K, tokens * K * E / (num_experts or E))
    return gemv_config(D, I, tokens * K)


def int4_plan(
    tokens: int, K: int, E: int, D: int, I: int, dtype: torch.dtype, kernels: KernelConfig, mma_ok: bool,
    num_experts: int = 0,
) -> tuple[str, dict, dict]:  # fmt: skip
    """(form, first tiles, second tiles) the default config takes for a step planned as `tokens` tokens over E
    local experts of num_experts in all (0: E). Both follow the planned size, not the step's own, so an eager
    decode step planned as its padded CUDA-graph twin (ForwardBatch.plan_tokens) computes each row as the graph
    does (kernels/plan.py walks it at Kimi-K2.5's shards)."""
    form = resolve_form("", tokens * K, E, D, I, kernels, mma_ok, num_experts)
    return form, *form_tiles(form, tokens, K, E, D, I, dtype, kernels, num_experts)


def _check(x, w13p, w13s, w2p, w2s, topk_weights, topk_ids):
    """-> (T, D, E, I, K); errors name the argument and the limit."""
    if x.dim() != 2 or x.dtype not in FLOATS or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, D] in one of {FLOATS} with a unit last stride, got {tuple(x.shape)} {x.dtype}")
    T, D = x.shape
    if D % 32:
        raise ValueError(f"x: hidden size D={D} must be a multiple of 32 (the INT4 scale group)")
    if w13p.dim() != 3 or w13p.shape[1] % 2 or w13p.shape[2] != D // 8:
        raise ValueError(f"w13_packed must be [E, 2I, {D // 8}] (D/8 words), got {tuple(w13p.shape)}")
    E, I = w13p.shape[0], w13p.shape[1] // 2
    if I % 32:
        raise ValueError(f"w13_packed: intermediate size I={I} must be a multiple of 32 (the INT4 scale group)")
    want = dict(
        w13_packed=(E, 2 * I, D // 8), w13_scale=(E, 2 * I, D // 32), w2_packed=(E, D, I // 8), w2_scale=(E, D, I // 32)
    )
    for (name, shape), t in zip(want.items(), (w13p, w13s, w2p, w2s)):
        packed = name.endswith("packed")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} (E={E}, I={I}, D={D}), got {list(t.shape)}")
        if (t.dtype != torch.int32) if packed else (t.dtype not in FLOATS):
            raise ValueError(f"{name} must be {'int32' if packed else 'bf16 (or fp16/fp32)'}, got {t.dtype}")
        if t.stride(-1) != 1 or t.device != x.device:
            raise ValueError(f"{name} must have a unit last stride and live on {x.device}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [{T}, K] int32 or int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    K = topk_ids.shape[1]
    if topk_weights.shape != (T, K) or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be [{T}, {K}] fp32, got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("topk_ids and topk_weights must be contiguous")
    return T, D, E, I, K


def int4_fused_experts(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
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
    num_experts: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """sum_k w[t,k] * down_e(silu(gate_e(x[t])) * up_e(x[t])) over the pairs whose expert e = id - expert_offset is
    in [0, E) (others contribute nothing: EP), plus `add` -> [T, D] in x.dtype; equals int4_fused_experts_ref. With
    norm = (weight [D], eps, residual [T, D]): -> (norm(out + residual), out + residual), the add + RMSNorm after the
    MoE fused into the sum (moe_sum).
    x [T, D]; w13_packed int32 [E, 2I, D/8] (gate rows, then up rows), w13_scale [E, 2I, D/32]; w2_packed int32
    [E, D, I/8], w2_scale [E, D, I/32]; topk_weights [T, K] fp32; topk_ids [T, K] int32/int64.
    all_local: every id names a local expert (no EP), so the sum reads no ids; pass False under EP.
    num_experts: the experts over all ranks (0: E); under EP the GEMV's tiles and pairing follow the share of a
    step's pairs the rank is expected to own (form_tiles, pair_width).
    kernels: its pdl switch and the INT4 GEMV thresholds (kernel_config.py). plan_tokens: form and tiles are chosen
    for max(T, plan_tokens) tokens (int4_plan), so a step computes each row as a step of that many would.
    config (benchmarks, tests): "form": "gemv" / "gemm" (default: int4_plan's), "gemv" meaning
    "gemv_mma" where mma_supported and mma_preferred, else "gemv_fma"; for gemv_mma "pair" (two pairs of one expert
    in one pass, default True); "mma1", "mma2" ({"MR", "WG", "PREFETCH", "MUL",
    "NS", "maxnreg"}, "NB"; with "MR" a whole tile, else changes to the default), "gemv1", "gemv2" ({"ROWS", "G",
    "num_warps"}) and "gemm1", "gemm2" (tiles; "BLOCK_M" shared; "TAIL": None, or
    changes to the tiles for moe_align's tail list, whose BLOCK_M is half) override the defaults."""
    T, D, E, I, K = _check(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids)
    if num_experts and (num_experts < E or all_local and num_experts != E):
        raise ValueError(
            f"num_experts={num_experts} must be 0 or at least the {E} local experts (and equal them with all_local)"
        )
    if T == 0:  # checks `add`; empty
        return moe_sum(x.new_empty(0, D), topk_ids, expert_offset, E, add, norm, all_local, kernels.pdl)
    pdl = pdl_args(x, kernels.pdl)  # every launch alike
    cfg = dict(config or {})
    keys = ("form", "pair", "mma1", "mma2", "gemv1", "gemv2", "gemm1", "gemm2")
    bad = set(cfg) - set(keys)
    if bad:
        raise ValueError(f"config keys {sorted(bad)} are not among {', '.join(keys)}")
    TK, P = T * K, max(T, plan_tokens)
    mma_ok = mma_supported(x, D, I)
    form = resolve_form(cfg.get("form"), P * K, E, D, I, kernels, mma_ok, num_experts)
    c1, c2 = form_tiles(form, P, K, E, D, I, x.dtype, kernels, num_experts)
    y = torch.empty(TK, D, dtype=x.dtype, device=x.device)
    args = (x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids)
    if form == "gemv_mma":
        if not mma_ok:
            raise ValueError(f"config: form='gemv_mma' needs bf16 x on sm_80+ and D={D}, I={I} multiples of 128")
        o1, o2 = cfg.get("mma1", {}), cfg.get("mma2", {})
        c1, c2 = (dict(o) if "MR" in o else dict(c, **o) for c, o in ((c1, o1), (c2, o2)))  # with MR: a whole tile
        hbuf = torch.empty(TK, I, dtype=x.dtype, device=x.device)
        int4_gemv_mma(
            *args,
            expert_offset,
            hbuf,
            y,
            pdl,
            c1,
            c2,
            pair=cfg.get("pair", True),
            plan_tokens=P,
            num_experts=num_experts,
        )
    elif form == "gemv_fma":
        c1, c2 = dict(c1, **cfg.get("gemv1", {})), dict(c2, **cfg.get("gemv2", {}))
        hbuf = torch.empty(TK, I, dtype=x.dtype, device=x.device)
        int4_gemv(*args, expert_offset, hbuf, y, pdl, c1, c2)
    else:  # gemm: over moe_align's blocks, and with a TAIL over its tail list too
        tiles = _gemm_tiles(dict(c1, **cfg.get("gemm1", {})), dict(c2, **cfg.get("gemm2", {})))
        lists = moe_align(topk_ids, E, expert_offset, tiles[0][0]["BLOCK_M"], pdl=kernels.pdl, tail=len(tiles) == 2)
        for (a, b), (sorted_ids, expert_ids, num_padded) in zip(tiles, (lists[:3], lists[3:])):
            hbuf = torch.empty(sorted_ids.shape[0], I, dtype=x.dtype, device=x.device)
            int4_gemm(*args, sorted_ids, expert_ids, num_padded, hbuf, y, pdl, a, b)
    return moe_sum(y, topk_ids, expert_offset, E, add, norm, all_local, kernels.pdl)
