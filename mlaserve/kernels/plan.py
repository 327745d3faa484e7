"""The reduction plan: which kernel form and tiles each GPU decision point takes for a step, as data.

`reduction_plan(kernels, tokens)` asks the same predicates the call sites ask (gemv_serves, head_gemv_serves, the
MoE's and FP8's form choices, moe_config, fp8_gemm_config, mla_decode.split_plan) for a step of `tokens` rows on the
GPU, without a GPU: the tensors are shapes only. In deterministic mode (KernelConfig.batch_invariant) every entry
but those of NOT_YET_INVARIANT_POINTS must be the same at every step size: a row's reduction order then depends
on the row alone. tests/kernels_interp/test_reduction_plan_interp.py walks it.
"""

from __future__ import annotations

import torch
import triton

from ..kernel_config import KernelConfig

# The plan's entries that configuration alone cannot make batch-invariant (kernel_config.NOT_YET_INVARIANT)
NOT_YET_INVARIANT_POINTS = ("fp8_gemm_tiles",)


class _OnGpu(torch.Tensor):
    """A meta tensor the predicates take for a CUDA one (they ask is_cuda first)."""

    @property
    def is_cuda(self) -> bool:
        return True


def _t(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta").as_subclass(_OnGpu)


def reduction_plan(
    kernels: KernelConfig,
    tokens: int,
    *,
    hidden: int = 1024,
    heads: int = 16,
    rank: int = 512,
    nope: int = 128,
    experts: int = 64,
    num_experts: int = 0,
    top_k: int = 6,
    n_shared: int = 2,
    moe_inter: int = 512,
    vocab: int = 32000,
    q_len: int = 1,
    seq_len: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
    plan_reqs: int | None = None,
) -> dict[str, object]:
    """Each decision point's choice for a step of `tokens` rows (decode: tokens // q_len requests, each with a
    seq_len context) of a model of these sizes (M1-like by default). plan_reqs: the decode requests the attention
    is planned for (ForwardBatch.plan_decode_reqs; default the step's own). experts: the routed experts on the rank;
    num_experts: over all ranks (0: experts; EP: the INT4 experts' form, tiles and pairing follow it)."""
    from .bi_gemm import TILES_16, TILES_32, k_splits
    from .fp8_gemm import fp8_gemm_config
    from .fp8_linear import linear_form
    from .fp8_moe import moe_form as fp8_moe_form
    from .fused_moe import experts_form
    from .gemv import gemv_serves
    from .head_gemv import head_gemv_serves
    from .int4_mma_run import pair_width
    from .int4_moe import int4_plan
    from .mla_decode import TMA_MIN_PROGRAMS, decode_config, split_plan
    from .moe_config import moe_config
    from .routing import ROUTER_SPLITK_MAX_EXPERTS

    T = tokens
    x, w = _t(T, hidden, dtype=dtype), _t(hidden, hidden, dtype=dtype)
    plan: dict[str, object] = {}
    plan["linear"] = "gemv" if gemv_serves(x, w, kernels.gemv_max_bytes, kernels.gemv_serve_tokens) else "gemm"
    plan["lm_head"] = (
        "gemv" if gemv_serves(x, _t(vocab, hidden, dtype=dtype), None, kernels.gemv_serve_tokens) else "gemm"
    )
    # the GEMMs the GEMVs leave (linears, lm_head, router, absorbed projections, kv_b_proj over a prefill's
    # context): cuBLAS picks its kernel and split-K by M; deterministic mode's bi_gemm has one tile
    # config and a K split fixed by the weight's shape
    bi = kernels.deterministic
    tiles = TILES_32 if dtype == torch.float32 else TILES_16
    plan["dense_gemm"] = ("bi_gemm", tuple(sorted(tiles.items())), k_splits(1, hidden, hidden, tiles))
    if not bi:
        plan["dense_gemm"] = ("cublas", T)
    q = _t(T, heads, nope, dtype=dtype)
    absorb = head_gemv_serves(q, _t(heads, nope, rank, dtype=dtype), kernels.head_gemv_max_tokens)
    plan["absorb"] = "head_gemv" if absorb else "bi_gemm" if bi else "bmm"
    plan["absorb_store"] = kernels.absorb_store and absorb
    # DeepseekV3MoE.forward and .route: the shared experts inside the fused MoE; the router's split-K GEMM
    fuse = T <= kernels.fuse_shared_max_tokens
    plan["fuse_shared"] = fuse
    splitk = T <= kernels.router_splitk_max_tokens and experts <= ROUTER_SPLITK_MAX_EXPERTS
    plan["router"] = "splitk" if splitk else "bi_gemm" if bi else "mm"
    e_all = experts + (n_shared if fuse else 0)
    config = dict(kernels.moe_fixed_config() or {})  # what layers.moe.Experts passes fused_experts
    k_all = top_k + (n_shared if fuse else 0)
    no_align, gemv = experts_form(x, k_all, config, kernels)
    config.pop("tma", None)  # TMA tiles are bit-equal to the pointer loads (docs/kernels.md): stages only
    config.pop("decode_tiles", None)  # deterministic mode's decode tiles are bit-equal to its fixed ones
    c1, c2 = moe_config(T, k_all, e_all, hidden, moe_inter, dtype, **config)
    plan["moe_form"] = "gemv" if gemv else "per_pair" if no_align else "aligned"
    plan["moe_tiles"] = None if gemv else (tuple(sorted(c1.items())), tuple(sorted(c2.items())))
    fw, fs = _t(hidden, hidden, dtype=torch.float8_e4m3fn), _t(hidden // 128, hidden // 128, dtype=torch.float32)
    form, a8 = linear_form(x.as_subclass(torch.Tensor), fw, fs, None, kernels)  # scaled_mm asks the device: not here
    if a8 and (T > kernels.fp8_scaled_mm_min_rows or hidden * hidden >= kernels.fp8_scaled_mm_min_bytes):
        form = "scaled_mm"  # where the GPU runs it (sm_90), else the Triton GEMM
    plan["fp8_linear"] = (form, a8)
    plan["fp8_gemm_tiles"] = fp8_gemm_config(T, hidden, hidden, a8, dtype) if form == "triton" else None
    plan["fp8_moe"] = fp8_moe_form(
        T, top_k, experts, None, kernels.no_align_max_pairs, dtype, kernels.fp8_a8_min_tokens
    )
    # the INT4 experts (int4_fused_experts): form and tiles for the planned tokens (an eager decode step: its graph
    # twin's, ForwardBatch.plan_tokens), mma_supported as on an sm_90 GPU (bf16, dims multiples of 128)
    P = max(T, (plan_reqs or 0) * q_len)
    mma_ok = dtype == torch.bfloat16 and hidden % 128 == 0 and moe_inter % 128 == 0
    form, c1, c2 = int4_plan(P, top_k, experts, hidden, moe_inter, dtype, kernels, mma_ok, num_experts)
    plan["int4_form"] = form
    pairing = pair_width(P, top_k, experts, num_experts) if form == "gemv_mma" else 0
    plan["int4_tiles"] = (tuple(sorted(c1.items())), tuple(sorted(c2.items())), pairing)
    # MLA decode: the splits, tiles, load path (TMA as the call site decides on an sm_90 GPU whose cache pages hold
    # whole tiles) and the cut of a seq_len context (the tokens of a split)
    B = max(1, T // q_len, plan_reqs or 0)
    if kernels.deterministic:  # a verify's rows run as decode rows of their own (attention/triton_mla.py)
        B, q_len = B * q_len, 1
    splits, cfg_args = kernels.mla_decode_args()
    block_h = decode_config(heads, q_len, dtype)["BLOCK_H"]
    tma = (cfg_args or {}).get("TMA", B * triton.cdiv(heads, block_h) >= TMA_MIN_PROGRAMS)
    S, tiles, min_tiles = split_plan(B, heads, q_len, dtype, torch.device("cpu"), splits, cfg_args, tma)
    bn = tiles["BLOCK_N"]
    cut = max(triton.cdiv(triton.cdiv(seq_len, bn), S), min_tiles) * bn
    plan["mla_decode"] = (S, bn, tiles["num_stages"], tma, cut)
    # rows a program holds (tokens of a verify block x heads): by q_len, except in deterministic mode
    plan["mla_rows"] = (tiles["BLOCK_QL"], tiles["BLOCK_H"], tiles["num_warps"])
    return plan
