"""DeepSeek-V3 `noaux_tc` routing after the router GEMM, in one Triton kernel (one program per token).

sigmoid -> + e_score_correction_bias -> group score = sum of the group's top-2 -> keep the best topk_group groups
-> top-K experts by biased score among them -> weights = unbiased scores, normalised, scaled. Same maths as
layers.moe.route_noaux_tc. Ties: every arg-max takes the LOWEST index among equal values (tl.argmax's
tie_break_left); torch.topk leaves the order of ties unspecified, so exact ties (measure zero for random fp32
logits) may pick a different but equally-scored expert.

With num_shared = S > 0 the kernel also writes S always-selected columns after the K routed ones: ids
shared_id0 + s, weight exactly 1.0 (not scaled): the shared experts' slots of fused_experts(shared=...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_start


@triton.jit
def _router_partial_kernel(X, W, Part, T, D, stride_xt, stride_we, stride_ps, stride_pt, KB_PER_SPLIT,
                           E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr):
    """Part[s, t, :] = x[t, chunk s] . w[:, chunk s] in fp32 (bf16 products are exact in fp32). Split-K over many
    programs: one program streaming the whole router weight is latency-bound (a few KB in flight)."""
    pdl_start(PDL)
    tb = tl.program_id(0)
    split = tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for kb in range(KB_PER_SPLIT):
        k = (split * KB_PER_SPLIT + kb) * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(X + t.to(tl.int64)[:, None] * stride_xt + k[None, :], mask=(t < T)[:, None] & (k < D)[None, :],
                    other=0.0)
        w = tl.load(W + e[:, None] * stride_we + k[None, :], mask=(e < E)[:, None] & (k < D)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(Part + split * stride_ps + t.to(tl.int64)[:, None] * stride_pt + e[None, :], acc,
             mask=(t < T)[:, None] & (e < E)[None, :])


@triton.jit
def _logits(row, idx, mask, stride_ls, SPLIT: tl.constexpr):
    """The router logits at idx: the sum of SPLIT partials, always in the same order (both layouts below agree)."""
    v = tl.load(row + idx, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        v += tl.load(row + s * stride_ls + idx, mask=mask, other=0.0)
    return v


@triton.jit
def _route_kernel(Logits, Bias, Weights, Ids, stride_lt, stride_ls, scaling, shared_id0,
                  E: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                  USE_GROUPS: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                  N_SHARED: tl.constexpr = 0, SPLIT: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Row t of Weights/Ids [T, TOP_K + N_SHARED]: the routed top-K, then the N_SHARED shared-expert columns.
    SPLIT > 1: Logits holds split-K partials [SPLIT, T, E] (stride_ls apart), summed here."""
    pdl_start(PDL)
    t = tl.program_id(0)
    row = Logits + t.to(tl.int64) * stride_lt
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    score = tl.sigmoid(_logits(row, offs, ok, stride_ls, SPLIT))
    choice = tl.where(ok, score + tl.load(Bias + offs, mask=ok, other=0.0), float("-inf"))
    if USE_GROUPS:
        GS: tl.constexpr = E // N_GROUP
        g = tl.arange(0, BLOCK_G)
        s = tl.arange(0, BLOCK_S)
        ok2 = (g < N_GROUP)[:, None] & (s < GS)[None, :]
        idx2 = g[:, None] * GS + s[None, :]
        c2 = tl.sigmoid(_logits(row, idx2, ok2, stride_ls, SPLIT))
        c2 = tl.where(ok2, c2 + tl.load(Bias + idx2, mask=ok2, other=0.0), float("-inf"))  # [G, S]
        top1 = tl.max(c2, 1)
        first = tl.argmax(c2, 1)
        top2 = tl.max(tl.where(s[None, :] == first[:, None], float("-inf"), c2), 1)
        gscore = tl.where(g < N_GROUP, top1 + top2, float("-inf"))
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, 0)
            keep = keep | (g == best)
            gscore = tl.where(g == best, float("-inf"), gscore)
        # expert -> kept?  via a [E, G] comparison (G <= 8)
        in_kept = tl.sum(((offs // GS)[:, None] == g[None, :]) & keep[None, :], 1) > 0
        choice = tl.where(in_kept, choice, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int64)
    ws = tl.zeros([BLOCK_K], tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(choice, 0)
        ids = tl.where(kk == k, best.to(tl.int64), ids)
        ws = tl.where(kk == k, tl.sum(tl.where(offs == best, score, 0.0), 0), ws)
        choice = tl.where(offs == best, float("-inf"), choice)
    if NORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    ws = ws * scaling
    if N_SHARED > 0:  # lanes past TOP_K held zeros above, so the norm summed the routed weights only
        ids = tl.where(kk >= TOP_K, shared_id0 + (kk - TOP_K).to(tl.int64), ids)
        ws = tl.where(kk >= TOP_K, 1.0, ws)
    KS: tl.constexpr = TOP_K + N_SHARED
    tl.store(Weights + t * KS + kk, ws, mask=kk < KS)
    tl.store(Ids + t * KS + kk, ids, mask=kk < KS)


def route_noaux_tc_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                          norm_topk_prob: bool, scaling: float, num_shared: int = 0,
                          shared_id0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, K+S] fp32, ids [T, K+S] int64); the fused form of route_noaux_tc, plus
    S = num_shared columns of ids shared_id0 + s with weight 1.0. logits may also be split-K partials [SPLIT, T, E]
    (router_partials), summed in the kernel."""
    split = 1
    if logits.dim() == 3:
        split = logits.shape[0]
        if not logits.is_contiguous() or not 1 <= split <= 64:
            raise ValueError(f"router partials {tuple(logits.shape)} must be contiguous [SPLIT <= 64, T, E]")
        logits = logits.view(split * logits.shape[1], logits.shape[2])[: logits.shape[1]]
    T, E = logits.shape
    if logits.dtype != torch.float32 or bias.shape != (E,) or bias.dtype != torch.float32:
        raise ValueError(f"router logits [T, E] and bias [E] must be fp32; got {logits.dtype}, {tuple(bias.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("router logits need a unit last stride")
    if E > 1024 or E % n_group or top_k > 16 or n_group > 64 or topk_group > n_group:
        raise ValueError(f"routing E={E} (<= 1024, divisible by n_group={n_group}), top_k={top_k} (<= 16), "
                         f"topk_group={topk_group} (<= n_group) out of range")
    if not 0 <= num_shared <= 16:
        raise ValueError(f"routing num_shared={num_shared} out of range [0, 16]")
    use_groups = n_group > 1 and topk_group < n_group
    if use_groups and (E // n_group < 2 or topk_group * (E // n_group) < top_k):
        raise ValueError(f"groups of {E // n_group} experts x topk_group={topk_group} cannot hold top_k={top_k}")
    KS = top_k + num_shared
    weights = torch.empty(T, KS, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, KS, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    _route_kernel[(T,)](
        logits, bias, weights, ids, logits.stride(0), T * E, float(scaling), int(shared_id0),
        E=E, N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, USE_GROUPS=use_groups, NORM=bool(norm_topk_prob),
        BLOCK_E=triton.next_power_of_2(E), BLOCK_G=max(2, triton.next_power_of_2(n_group)),
        BLOCK_S=max(2, triton.next_power_of_2(E // n_group)), BLOCK_K=max(2, triton.next_power_of_2(KS)),
        N_SHARED=num_shared, SPLIT=split, num_warps=4 if E > 128 else 1, **pdl_args(logits),
    )
    return weights, ids


# Decode steps of up to 256 experts: the router GEMM as split-K partials (cuBLAS took 5.2 us at batch 1 for the
# 0.25 MB Moonlight router); Kimi's 384-expert tile would need 135 KB of shared memory a program: cuBLAS.
ROUTER_SPLITK_MAX_TOKENS = 32
ROUTER_SPLITK_MAX_EXPERTS = 256
ROUTER_BLOCK_K = 64
ROUTER_SPLITS = 32  # ~8 KB of a 64-expert, 2048-wide weight per program


def router_partials(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, D] bf16, w [E, D] bf16 -> split-K partial logits [SPLIT, T, E] fp32 (their sum is x . w^T)."""
    T, D = x.shape
    E = w.shape[0]
    if w.shape[1] != D or x.dtype != w.dtype or w.stride(-1) != 1 or x.stride(-1) != 1 or E > 1024:
        raise ValueError(f"router x {tuple(x.shape)} {x.dtype} / w {tuple(w.shape)} {w.dtype}: need [T, D] and "
                         f"[E <= 1024, D] of one dtype with unit last strides")
    n_kb = triton.cdiv(D, ROUTER_BLOCK_K)
    kb_per_split = triton.cdiv(n_kb, ROUTER_SPLITS)
    split = triton.cdiv(n_kb, kb_per_split)
    part = torch.empty(split, T, E, dtype=torch.float32, device=x.device)
    if T:
        block_t = 16  # tl.dot's smallest M; decode steps are a block or two
        _router_partial_kernel[(triton.cdiv(T, block_t), split)](
            x, w, part, T, D, x.stride(0), w.stride(0), part.stride(0), part.stride(1), kb_per_split,
            E=E, BLOCK_T=block_t, BLOCK_E=max(16, triton.next_power_of_2(E)), BLOCK_K=ROUTER_BLOCK_K, num_warps=4,
            **pdl_args(x))
    return part


def route_noaux_tc_fused(gate, x: torch.Tensor, num_shared: int = 0,
                         shared_id0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """gate: layers.moe.TopkRouter; x [T, D] -> (weights [T, K+S] fp32, ids [T, K+S] int64), S = num_shared
    columns of ids shared_id0 + s with weight 1.0 after the routed K (see route_noaux_tc_logits)."""
    c = gate.cfg
    w16 = gate.bf16_weight() if x.is_cuda and x.dtype == torch.bfloat16 else None
    splitk = (w16 is not None and x.shape[0] <= ROUTER_SPLITK_MAX_TOKENS and x.stride(-1) == 1
              and w16.shape[0] <= ROUTER_SPLITK_MAX_EXPERTS)
    if splitk:
        logits = router_partials(x, w16)  # [SPLIT, T, E] fp32, summed by the routing kernel
    elif w16 is not None:  # a bf16 GEMM with fp32 output: no fp32 copy of x, no fp32 GEMM (TopkRouter.bf16_weight)
        logits = torch.mm(x, w16.t(), out_dtype=torch.float32)  # [T, E] fp32
    else:
        logits = F.linear(x.float(), gate.weight)  # [T, E] fp32 (cuBLAS; a Triton GEMV measured slower in decode)
    return route_noaux_tc_logits(logits, gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
                                 c.topk_group, c.norm_topk_prob, c.routed_scaling_factor, num_shared, shared_id0)
