"""The distributed state: one process group spanning the tensor-parallel ranks, and its collectives.

This module's globals are the only ones in mlaserve. With one rank every collective is a no-op, so the
model code calls them unconditionally. Tensors go over the model group (NCCL on GPU, gloo on CPU), small
all-reduces on one node over symmetric memory (allreduce.py); control messages (capture, stop) go over a gloo group
on the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import RankInfo

__all__ = ["RankInfo"]  # defined with the other frozen configs; the model code imports it from here too


_GROUP: dist.ProcessGroup | None = None
_CPU_GROUP: dist.ProcessGroup | None = None
_RANK_INFO = RankInfo()
_SYMM = None  # allreduce.SymmMemAllReduce, or None: every all-reduce goes to the model group
_STORE = None  # the rendezvous store (tcp://), which carries the heartbeats of ranks on other machines
_ORDERED = False  # deterministic mode: every all-reduce is an all-gather and a sum in rank order


def set_group(
    group: dist.ProcessGroup | None,
    info: RankInfo,
    cpu_group: dist.ProcessGroup | None = None,
    symm=None,
    store=None,
) -> None:
    """Install this process's groups; `cpu_group` (gloo) carries broadcast_object, defaulting to `group`; `symm`
    (allreduce.SymmMemAllReduce) takes the all-reduces it selects; `store`: the rendezvous store."""
    global _GROUP, _CPU_GROUP, _RANK_INFO, _SYMM, _STORE
    _GROUP, _CPU_GROUP, _RANK_INFO = group, cpu_group if cpu_group is not None else group, info
    _SYMM, _STORE = symm, store


def rank_info() -> RankInfo:
    return _RANK_INFO


def group() -> dist.ProcessGroup | None:
    return _GROUP


def cpu_group() -> dist.ProcessGroup | None:
    return _CPU_GROUP


def store():
    """The rendezvous store (a dist.TCPStore), or None."""
    return _STORE


def symm_all_reduce():
    """The symmetric-memory all-reduce (allreduce.SymmMemAllReduce), or None."""
    return _SYMM


def set_ordered_all_reduce(on: bool) -> None:
    """Deterministic mode (KernelConfig.deterministic) on this rank: each all-reduce gathers every rank's tensor and
    sums them in rank order in fp32, rounding once, so an element's sum does not depend on the message's size
    (NCCL's ring and tree chunk a message by its size, and allreduce.select picks its path by size too)."""
    global _ORDERED
    _ORDERED = on


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """In-place sum over the TP ranks; returns x. Symmetric memory where allreduce.select picks it, else the group's;
    in deterministic mode an all-gather and a sum in rank order."""
    if _RANK_INFO.world_size == 1:
        return x
    if _ORDERED:
        return _ordered_all_reduce(x)
    if _SYMM is None or not _SYMM.try_all_reduce(x):
        dist.all_reduce(x, group=_GROUP)
    return x


def _ordered_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """x [...] on each rank -> x = ((0 + x_0) + x_1) + ... in fp32, rounded once to x's dtype, the same on every rank
    and for every element whatever the message's size. W times the bytes of an all-reduce: the mode's price."""
    w = _RANK_INFO.world_size
    g = x.new_empty(w * x.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(g, x.contiguous().view(-1), group=_GROUP)
    g = g.view(w, *x.shape)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for r in range(w):  # elementwise, in rank order
        acc += g[r]
    return x.copy_(acc)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[.., n] on each rank -> [.., world * n], rank-major."""
    if _RANK_INFO.world_size == 1:
        return x
    x = x.contiguous()
    w = _RANK_INFO.world_size
    out = x.new_empty(w * x.shape[0], *x.shape[1:])  # one collective into one buffer: CUDA-graph friendly
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, x, group=_GROUP)
    return out.view(w, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """[n, ...] on each rank (n the same on all) -> [world * n, ...], rank-major."""
    if _RANK_INFO.world_size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty(_RANK_INFO.world_size * x.shape[0], *x.shape[1:])
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=_GROUP)
    return out


def all_to_all_counts(send: torch.Tensor) -> torch.Tensor:
    """send [world] int64 (rows this rank sends each rank) -> [world], the rows each rank sends this one."""
    if _RANK_INFO.world_size == 1:
        return send.clone()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=_GROUP)
    return recv


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """x [sum(send), ...], rank-major blocks of send[r] rows for rank r -> [sum(recv), ...], recv[r] rows from
    rank r. Split sizes are host lists: not CUDA-graph safe."""
    if _RANK_INFO.world_size == 1:
        return x
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=_GROUP)
    return out


def broadcast_object(obj=None, src: int = 0):
    """Rank `src` (global rank) sends a picklable object to every rank (batch metadata under TP), over the host."""
    if _RANK_INFO.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_CPU_GROUP, device=torch.device("cpu"))
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's picklable `obj`, in rank order (e.g. each rank's weight bytes after load), over the host group."""
    if _RANK_INFO.world_size == 1:
        return [obj]
    out = [None] * _RANK_INFO.world_size
    dist.all_gather_object(out, obj, group=_CPU_GROUP)
    return out


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's value (e.g. KV pages that fit on every GPU), over the host group."""
    if _RANK_INFO.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return int(t.item())
