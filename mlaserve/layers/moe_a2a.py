"""Expert parallelism by all-to-all dispatch and combine (the "normal", high-throughput form of DeepEP and of vLLM's
and SGLang's EP), for the replicated tokens of attention TP.

Every rank holds the step's T tokens. Rank r takes its own slice of them (ceil(T / W) rows; the last ranks may get
fewer, or none), routes it, and sends each token once to every rank that owns one or more of its top-k experts
(all the moe-TP ranks of that expert's EP group, each holding a shard of its intermediate dim), with the token's
top-k weights and ids. A receiving rank runs its experts on the compact list it received (the same grouped / fused
path as the all-reduce form: ids it does not own contribute nothing) and sends each row's partial sum back; the
sender sums a token's partials, one per rank it went to. The replicated hidden state is restored by the caller
(restore_replicated). Split sizes are exchanged first and read on the host (a sync a layer), so this path never
runs inside a CUDA graph (engine/cuda_graph.py keeps steps of moe_a2a_min_tokens or more eager under EP).

A token is sent once per destination rank, not once per (token, expert) pair: with top-8 over 2 ranks that is at
most one remote copy instead of up to eight, and the receiver's sum over its own experts is fused into its MoE.
"""

from __future__ import annotations

import torch

from ..distributed import tp
from ..distributed.tp import RankInfo


def use_a2a(n_tokens: int, ranks: RankInfo, min_tokens: int | None) -> bool:
    """Whether a step of n_tokens takes the all-to-all form (KernelConfig.moe_a2a_min_tokens; EP only)."""
    return ranks.ep_size > 1 and min_tokens is not None and n_tokens >= min_tokens


def token_slice(n_tokens: int, rank: int, world: int) -> tuple[int, int, int]:
    """(lo, hi, rows per rank): rank's rows [lo, hi) of n_tokens split in blocks of ceil(n_tokens / world)."""
    per = -(-n_tokens // world)
    lo = min(rank * per, n_tokens)
    return lo, min(lo + per, n_tokens), per


def destinations(ids: torch.Tensor, num_local: int, ranks: RankInfo) -> torch.Tensor:
    """ids [Ts, K] (global expert ids) -> [Ts, W] bool: the ranks each token goes to. Rank = ep_rank * moe_tp_size +
    moe_tp_rank, so an EP group's moe-TP ranks are consecutive and each gets the token."""
    hit = torch.zeros(ids.shape[0], ranks.ep_size, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, (ids // num_local).long(), True)  # [Ts, P]
    return hit.repeat_interleave(ranks.moe_tp_size, dim=1)


def _pack(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One byte row per token: x [N, D] | weights [N, K] fp32 | ids [N, K] int32 -> [N, D * es + 8K] uint8, so the
    dispatch is one collective."""
    parts = (x.contiguous(), weights.float().contiguous(), ids.to(torch.int32).contiguous())
    return torch.cat([p.view(torch.uint8) for p in parts], dim=1)


def _unpack(rows: torch.Tensor, dtype: torch.dtype, D: int, K: int) -> tuple[torch.Tensor, ...]:
    nx = D * dtype.itemsize
    x = rows[:, :nx].contiguous().view(dtype)
    weights = rows[:, nx : nx + 4 * K].contiguous().view(torch.float32)
    ids = rows[:, nx + 4 * K :].contiguous().view(torch.int32)
    return x, weights, ids


def dispatch_combine(experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, impl: str) -> torch.Tensor:
    """This rank's slice x [Ts, D] with its routing (weights [Ts, K] fp32, ids [Ts, K]) -> the routed experts'
    output [Ts, D], summed over every rank's experts. Every rank must call it (it is two all-to-alls and a count
    exchange), also with Ts = 0. experts: an ExpertsBase (its expert_offset / num_local say what it owns)."""
    ranks = tp.rank_info()
    W, (Ts, D), K = ranks.world_size, x.shape, ids.shape[1]
    mask = destinations(ids, experts.num_local, ranks)  # [Ts, W]
    dest, tok = mask.t().nonzero(as_tuple=True)  # [N] each, rank-major: the rows for rank 0 first
    send_counts = mask.sum(0)  # [W]
    counts = torch.cat([send_counts, tp.all_to_all_counts(send_counts)]).tolist()  # host sync (as nonzero)
    send, recv = counts[:W], counts[W:]
    rows = tp.all_to_all_rows(_pack(x[tok], weights[tok], ids[tok]), send, recv)  # [R, D * es + 8K]
    xr, wr, ir = _unpack(rows, x.dtype, D, K)
    if xr.shape[0]:
        yr = experts(xr, wr, ir.to(ids.dtype), impl=impl)  # [R, D]: partial sums over this rank's experts
    else:
        yr = xr.new_zeros(0, D)
    back = tp.all_to_all_rows(yr, recv, send)  # [N, D], in the order sent
    # Each destination's rows name distinct tokens, so each index_add below writes a row at most once (no
    # atomics racing on CUDA); the partials are summed in rank order in fp32: deterministic on every device.
    out = torch.zeros(Ts, D, dtype=torch.float32, device=x.device)
    for part, rows_tok in zip(back.split(send), tok.split(send)):
        out.index_add_(0, rows_tok, part.float())
    return out.to(x.dtype)


def restore_replicated(y_slice: torch.Tensor, n_tokens: int, shared_partial: torch.Tensor | None) -> torch.Tensor:
    """Every rank's routed slice y_slice [Ts, D] (its token_slice) -> the block's output [n_tokens, D] on every rank.

    Without shared experts: one all-gather of the slices (each rank receives (W-1)/W * T * D elements). With them,
    their output is a partial over the world (TP-split like the dense MLP): the slice is added into this rank's
    rows of that partial and one all-reduce sums both. That moves what a reduce-scatter of the shared partial then
    an all-gather of slice + shared would ((W-1)/W * T * D each way), in one collective, and on the same
    message-size-selected all-reduce as the MoE-TP form; an all-gather of the slices plus an all-reduce of the
    shared partial would move half as much again."""
    ranks = tp.rank_info()
    lo, hi, per = token_slice(n_tokens, ranks.rank, ranks.world_size)
    if shared_partial is not None:
        shared_partial[lo:hi] += y_slice
        return tp.all_reduce(shared_partial)
    padded = y_slice.new_zeros(per, y_slice.shape[1])
    padded[: hi - lo] = y_slice
    return tp.all_gather_rows(padded)[:n_tokens]
