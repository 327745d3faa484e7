"""The distributed state: one process group spanning the tensor-parallel ranks, and its collectives.

This module's globals are the only ones in mlaserve. With one rank every collective is a no-op, so the
model code calls them unconditionally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits. world = attn_tp_size = moe_tp_size * ep_size."""

    rank: int = 0
    world_size: int = 1
    moe_tp_size: int = 1
    ep_size: int = 1

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size


_GROUP: dist.ProcessGroup | None = None
_RANK_INFO = RankInfo()


def set_group(group: dist.ProcessGroup | None, info: RankInfo) -> None:
    global _GROUP, _RANK_INFO
    _GROUP, _RANK_INFO = group, info


def rank_info() -> RankInfo:
    return _RANK_INFO


def group() -> dist.ProcessGroup | None:
    return _GROUP


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """In-place sum over the TP ranks; returns x."""
    if _RANK_INFO.world_size > 1:
        dist.all_reduce(x, group=_GROUP)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[.., n] on each rank -> [.., world * n], rank-major."""
    if _RANK_INFO.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_RANK_INFO.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_GROUP)
    return torch.cat(parts, dim=-1)


def broadcast_object(obj=None, src: int = 0):
    """Rank `src` sends a picklable object to every rank (batch metadata under TP)."""
    if _RANK_INFO.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_GROUP)
    return box[0]
