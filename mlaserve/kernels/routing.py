"""DeepSeek-V3 `noaux_tc` and DeepSeek-V2 softmax routing after the router GEMM, in Triton: one program per token;
decode steps feed it split-K router partials (router_partials), summed in the kernel.

V3 (sigmoid): sigmoid -> + e_score_correction_bias -> group score = sum of the group's top-2 -> keep the best
topk_group groups -> top-K experts by biased score among them -> weights = unbiased scores, normalised, scaled. Same
maths as layers.moe.route_noaux_tc. V2 (softmax): softmax over the experts (bias zeros) -> group score = the group's
max (group_limited_greedy; greedy has no groups) -> the same selection and weights: layers.moe.route_softmax.

Ties: every arg-max takes the LOWEST index among equal values (tl.argmax's tie_break_left); torch.topk leaves the
order of ties unspecified, so exact ties (measure zero for random fp32 logits) may pick a different but
equally-scored expert.

With num_shared = S > 0 the kernels also write S always-selected columns after the K routed ones: ids
shared_id0 + s, weight exactly 1.0 (not scaled): the shared experts' slots of fused_experts(shared=...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..kernel_config import KernelConfig
from .pdl import pdl_args, pdl_release, pdl_wait


@triton.jit
def _logits(ptrs, mask, stride_ls, SPLIT: tl.constexpr):
    """The router logits at ptrs: the sum of SPLIT partials, always in the same order (both views below agree)."""
    v = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        v += tl.load(ptrs + s * stride_ls, mask=mask, other=0.0)
    return v


@triton.jit
def _route_rows(
    Logits,
    t,
    t_ok,
    stride_lt,
    stride_ls,
    bias,
    Bias,
    Weights,
    Ids,
    scaling,
    shared_id0,
    E: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    USE_GROUPS: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    N_SHARED: tl.constexpr,
    SPLIT: tl.constexpr,
    SOFTMAX: tl.constexpr = False,
):
    """Routes tokens t [R] (int64; t_ok [R] masks them): rows t of Weights/Ids [T, TOP_K + N_SHARED]; bias: Bias
    [BLOCK_E] (the e_score_correction_bias, -inf past E), loaded by the caller before its PDL wait. Each token's
    result depends on its logits only (arg-maxes, sums of one non-zero, the norm's sum accumulated in k order), so
    any R and any num_warps give the same bits."""
    offs = tl.arange(0, BLOCK_E)
    rows = Logits + t * stride_lt  # [R]
    ok = t_ok[:, None] & (offs < E)[None, :]
    logits = _logits(rows[:, None] + offs[None, :], ok, stride_ls, SPLIT)  # [R, E]
    if SOFTMAX:  # masked lanes: exp(-inf) = 0, then the bias's -inf
        lmax = tl.max(tl.where(ok, logits, float("-inf")), 1)  # [R]
        expo = tl.exp(tl.where(ok, logits, float("-inf")) - lmax[:, None])
        denom = tl.sum(expo, 1)  # [R]
        score = expo / denom[:, None]
    else:
        score = tl.sigmoid(logits)
    choice = score + bias[None, :]
    if USE_GROUPS:
        GS: tl.constexpr = E // N_GROUP
        g = tl.arange(0, BLOCK_G)
        s = tl.arange(0, BLOCK_S)
        if BLOCK_G * BLOCK_S == BLOCK_E and GS == BLOCK_S:  # E and the group count powers of two: a view
            c2 = tl.reshape(choice, [t.shape[0], BLOCK_G, BLOCK_S])  # [R, G, S]
        else:  # the grouped view loaded again (the same sum, so the same values)
            ok2 = (g < N_GROUP)[:, None] & (s < GS)[None, :]
            idx2 = g[:, None] * GS + s[None, :]  # [G, S]
            l2 = _logits(
                rows[:, None, None] + idx2[None, :, :], t_ok[:, None, None] & ok2[None, :, :], stride_ls, SPLIT
            )
            if SOFTMAX:  # the same elementwise ops on the same values as above: the same scores
                c2 = tl.exp(l2 - lmax[:, None, None]) / denom[:, None, None]
            else:
                c2 = tl.sigmoid(l2)
            c2 = tl.where(
                ok2[None, :, :], c2 + tl.load(Bias + idx2, mask=ok2, other=0.0)[None, :, :], float("-inf")
            )  # [R, G, S]
        top1 = tl.max(c2, 2)
        if SOFTMAX:  # V2's group_limited_greedy: a group scores its best expert
            gsum = top1
        else:
            first = tl.argmax(c2, 2)
            gsum = top1 + tl.max(tl.where(s[None, None, :] == first[:, :, None], float("-inf"), c2), 2)
        gscore = tl.where((g < N_GROUP)[None, :], gsum, float("-inf"))  # [R, G]
        in_kept = tl.zeros([t.shape[0], BLOCK_E], tl.int32) != 0  # expert in a kept group? [R, E]
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, 1)  # [R]
            in_kept = in_kept | ((offs // GS)[None, :] == best[:, None])
            gscore = tl.where(g[None, :] == best[:, None], float("-inf"), gscore)
        choice = tl.where(in_kept, choice, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([t.shape[0], BLOCK_K], tl.int64)
    ws = tl.zeros([t.shape[0], BLOCK_K], tl.float32)
    total = tl.zeros([t.shape[0]], tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(choice, 1)  # [R]
        hit = offs[None, :] == best[:, None]
        wk = tl.sum(tl.where(hit, score, 0.0), 1)  # one non-zero: exact
        ids = tl.where(kk[None, :] == k, best.to(tl.int64)[:, None], ids)
        ws = tl.where(kk[None, :] == k, wk[:, None], ws)
        total += wk  # in k order: no reduction tree whose shape depends on the layout
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        ws = ws / (total[:, None] + 1e-20)
    ws = ws * scaling
    if N_SHARED > 0:  # the norm summed the routed weights only
        ids = tl.where(kk[None, :] >= TOP_K, shared_id0 + (kk - TOP_K).to(tl.int64)[None, :], ids)
        ws = tl.where(kk[None, :] >= TOP_K, 1.0, ws)
    KS: tl.constexpr = TOP_K + N_SHARED
    out = t[:, None] * KS + kk[None, :]
    mask = t_ok[:, None] & (kk < KS)[None, :]
    tl.store(Weights + out, ws, mask=mask)
    tl.store(Ids + out, ids, mask=mask)


@triton.jit
def _route_kernel(
    Logits,
    Bias,
    Weights,
    Ids,
    stride_lt,
    stride_ls,
    scaling,
    shared_id0,
    E: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    USE_GROUPS: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    N_SHARED: tl.constexpr = 0,
    SPLIT: tl.constexpr = 1,
    SOFTMAX: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """One program per token. SPLIT > 1: Logits holds split-K partials [SPLIT, T, E] (stride_ls apart)."""
    pdl_release(PDL)
    t = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    offs = tl.arange(0, BLOCK_E)
    bias = tl.load(Bias + offs, mask=offs < E, other=float("-inf"))  # a weight: before the wait (else a DRAM trip)
    pdl_wait(PDL)
    _route_rows(
        Logits,
        t,
        t >= 0,
        stride_lt,
        stride_ls,
        bias,
        Bias,
        Weights,
        Ids,
        scaling,
        shared_id0,
        E,
        N_GROUP,
        TOPK_GROUP,
        TOP_K,
        USE_GROUPS,
        NORM,
        BLOCK_E,
        BLOCK_G,
        BLOCK_S,
        BLOCK_K,
        N_SHARED,
        SPLIT,
        SOFTMAX,
    )


@triton.jit
def _w_tile(W, kb, D, stride_we, E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Router weight tile [BLOCK_E, BLOCK_K] of K block kb (zeros past E and D)."""
    e = tl.arange(0, BLOCK_E)
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(W + e[:, None] * stride_we + k[None, :], mask=(e < E)[:, None] & (k < D)[None, :], other=0.0)


@triton.jit
def _x_tile(X, t, kb, T, D, stride_xt, BLOCK_K: tl.constexpr):
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(
        X + t.to(tl.int64)[:, None] * stride_xt + k[None, :], mask=(t < T)[:, None] & (k < D)[None, :], other=0.0
    )


@triton.jit
def _router_partial(
    X,
    W,
    Part,
    w0,
    tb,
    split,
    T,
    D,
    stride_xt,
    stride_we,
    stride_ps,
    stride_pt,
    KB_PER_SPLIT,
    E: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Part[split, block tb, :] = x[block tb, chunk split] . w[:, chunk split]^T in fp32 (bf16 products are exact in
    fp32); w0 is the chunk's first weight tile, loaded by the caller before its PDL wait."""
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    kb0 = split * KB_PER_SPLIT
    acc = tl.dot(_x_tile(X, t, kb0, T, D, stride_xt, BLOCK_K), tl.trans(w0), tl.zeros([BLOCK_T, BLOCK_E], tl.float32))
    for kb in range(kb0 + 1, kb0 + KB_PER_SPLIT):
        w = _w_tile(W, kb, D, stride_we, E, BLOCK_E, BLOCK_K)
        acc = tl.dot(_x_tile(X, t, kb, T, D, stride_xt, BLOCK_K), tl.trans(w), acc)
    e = tl.arange(0, BLOCK_E)
    tl.store(
        Part + split * stride_ps + t.to(tl.int64)[:, None] * stride_pt + e[None, :],
        acc,
        mask=(t < T)[:, None] & (e < E)[None, :],
    )


@triton.jit
def _router_partial_kernel(
    X,
    W,
    Part,
    T,
    D,
    stride_xt,
    stride_we,
    stride_ps,
    stride_pt,
    KB_PER_SPLIT,
    E: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (token blocks, SPLIT): split-K over many programs; one program streaming the whole router weight is
    latency-bound (a few KB in flight)."""
    pdl_release(PDL)
    split = tl.program_id(1)
    w0 = _w_tile(W, split * KB_PER_SPLIT, D, stride_we, E, BLOCK_E, BLOCK_K)  # a weight: before the wait
    pdl_wait(PDL)
    _router_partial(
        X,
        W,
        Part,
        w0,
        tl.program_id(0),
        split,
        T,
        D,
        stride_xt,
        stride_we,
        stride_ps,
        stride_pt,
        KB_PER_SPLIT,
        E,
        BLOCK_T,
        BLOCK_E,
        BLOCK_K,
    )


def _routing_meta(
    E: int, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool, num_shared: int, scoring_func: str
) -> dict:
    """Checks a routing config; -> the routing constexprs of _route_rows."""
    if scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"routing scoring_func={scoring_func!r}: sigmoid (DeepSeek-V3) or softmax (DeepSeek-V2)")
    if E > 1024 or E % n_group or top_k > 16 or n_group > 64 or topk_group > n_group:
        raise ValueError(
            f"routing E={E} (<= 1024, divisible by n_group={n_group}), top_k={top_k} (<= 16), "
            f"topk_group={topk_group} (<= n_group) out of range"
        )
    if not 0 <= num_shared <= 16:
        raise ValueError(f"routing num_shared={num_shared} out of range [0, 16]")
    use_groups = n_group > 1 and topk_group < n_group
    if use_groups and (E // n_group < 2 or topk_group * (E // n_group) < top_k):
        raise ValueError(f"groups of {E // n_group} experts x topk_group={topk_group} cannot hold top_k={top_k}")
    return dict(
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        USE_GROUPS=use_groups,
        NORM=bool(norm_topk_prob),
        BLOCK_E=triton.next_power_of_2(E),
        BLOCK_G=max(2, triton.next_power_of_2(n_group)),
        BLOCK_S=max(2, triton.next_power_of_2(E // n_group)),
        BLOCK_K=max(2, triton.next_power_of_2(top_k + num_shared)),
        N_SHARED=num_shared,
        SOFTMAX=scoring_func == "softmax",
    )


def route_noaux_tc_logits(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    num_shared: int = 0,
    shared_id0: int = 0,
    pdl: bool = True,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, K+S] fp32, ids [T, K+S] int64); the fused form of route_noaux_tc
    (scoring_func "softmax": of route_softmax, with bias zeros), plus S = num_shared columns of ids shared_id0 + s
    with weight 1.0. logits may also be split-K partials [SPLIT, T, E] (router_partials), summed in the kernel."""
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
    meta = _routing_meta(E, top_k, n_group, topk_group, norm_topk_prob, num_shared, scoring_func)
    KS = top_k + num_shared
    weights = torch.empty(T, KS, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, KS, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    _route_kernel[(T,)](
        logits,
        bias,
        weights,
        ids,
        logits.stride(0),
        T * E,
        float(scaling),
        int(shared_id0),
        E=E,
        SPLIT=split,
        num_warps=4 if E > 128 else 1,
        **meta,
        **pdl_args(logits, pdl),
    )
    return weights, ids


# Decode steps (KernelConfig.router_splitk_max_tokens) of up to 256 experts: the router GEMM as split-K partials
# (cuBLAS took 5.2 us at batch 1 for the 0.25 MB Moonlight router); Kimi's 384-expert tile would need 135 KB of
# shared memory a program: cuBLAS.
ROUTER_SPLITK_MAX_EXPERTS = 256
ROUTER_BLOCK_T = 16  # tl.dot's smallest M; decode steps are a block or two
ROUTER_BLOCK_K = 64
ROUTER_SPLITS = 32  # ~8 KB of a 64-expert, 2048-wide weight per program


def _splitk_args(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """Checks the router operands; -> (K blocks per split, splits, partials buffer [SPLIT, T, E] fp32)."""
    T, D = x.shape
    E = w.shape[0]
    if w.shape[1] != D or x.dtype != w.dtype or w.stride(-1) != 1 or x.stride(-1) != 1 or E > 1024:
        raise ValueError(
            f"router x {tuple(x.shape)} {x.dtype} / w {tuple(w.shape)} {w.dtype}: need [T, D] and "
            f"[E <= 1024, D] of one dtype with unit last strides"
        )
    n_kb = triton.cdiv(D, ROUTER_BLOCK_K)
    kb_per_split = triton.cdiv(n_kb, ROUTER_SPLITS)
    split = triton.cdiv(n_kb, kb_per_split)
    return kb_per_split, split, torch.empty(split, T, E, dtype=torch.float32, device=x.device)


def router_partials(x: torch.Tensor, w: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """x [T, D] bf16, w [E, D] bf16 -> split-K partial logits [SPLIT, T, E] fp32 (their sum is x . w^T)."""
    kb_per_split, split, part = _splitk_args(x, w)
    T, D = x.shape
    E = w.shape[0]
    if T:
        _router_partial_kernel[(triton.cdiv(T, ROUTER_BLOCK_T), split)](
            x,
            w,
            part,
            T,
            D,
            x.stride(0),
            w.stride(0),
            part.stride(0),
            part.stride(1),
            kb_per_split,
            E=E,
            BLOCK_T=ROUTER_BLOCK_T,
            BLOCK_E=max(16, triton.next_power_of_2(E)),
            BLOCK_K=ROUTER_BLOCK_K,
            num_warps=4,
            **pdl_args(x, pdl),
        )
    return part


def route_splitk(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    num_shared: int = 0,
    shared_id0: int = 0,
    pdl: bool = True,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] bf16, w [E, D] bf16 -> route_noaux_tc_logits(router_partials(x, w), ...): two launches."""
    return route_noaux_tc_logits(
        router_partials(x, w, pdl),
        bias,
        top_k,
        n_group,
        topk_group,
        norm_topk_prob,
        scaling,
        num_shared,
        shared_id0,
        pdl,
        scoring_func,
    )


def route_noaux_tc_fused(
    gate,
    x: torch.Tensor,
    num_shared: int = 0,
    shared_id0: int = 0,
    splitk_max_tokens: int = KernelConfig.router_splitk_max_tokens,
    pdl: bool = True,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate: layers.moe.TopkRouter (its config's scoring_func: V3 or V2 routing); x [T, D] -> (weights [T, K+S] fp32,
    ids [T, K+S] int64), S = num_shared columns of ids shared_id0 + s with weight 1.0 after the routed K (see
    route_noaux_tc_logits). bf16 steps of up to splitk_max_tokens tokens run the router GEMM as split-K partials;
    deterministic: on the GPU every step by bi_gemm (the same per row at every size; split-K is then pinned off)."""
    c = gate.cfg
    w16 = gate.bf16_weight() if x.is_cuda and x.dtype == torch.bfloat16 else None
    args = (
        gate.e_score_correction_bias,
        c.num_experts_per_tok,
        c.n_group,
        c.topk_group,
        c.norm_topk_prob,
        c.routed_scaling_factor,
        num_shared,
        shared_id0,
    )
    T = x.shape[0]
    if (
        w16 is not None and T <= splitk_max_tokens and x.stride(-1) == 1 and w16.shape[0] <= ROUTER_SPLITK_MAX_EXPERTS
    ):  # the router GEMM as split-K partials
        return route_splitk(x, w16, *args, pdl, c.scoring_func)
    if deterministic and x.is_cuda:
        from .bi_gemm import bi_gemm

        w = gate.weight if w16 is None else w16
        logits = bi_gemm(x if w16 is not None else x.float(), w, out_dtype=torch.float32, pdl=pdl)  # [T, E] fp32
        return route_noaux_tc_logits(logits, *args, pdl, c.scoring_func)
    if w16 is not None:  # a bf16 GEMM with fp32 output: no fp32 copy of x, no fp32 GEMM (TopkRouter.bf16_weight)
        logits = torch.mm(x, w16.t(), out_dtype=torch.float32)  # [T, E] fp32
    else:
        logits = F.linear(x.float(), gate.weight)  # [T, E] fp32 (cuBLAS; a Triton GEMV measured slower in decode)
    return route_noaux_tc_logits(logits, *args, pdl, c.scoring_func)
