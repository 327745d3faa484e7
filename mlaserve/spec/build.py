"""The proposer a SpecConfig asks for, and the KV bytes per page its draft model adds to the target's."""

from __future__ import annotations

import torch

from ..config import ModelConfig, SpecConfig


def draft_kv_page_bytes(
    spec: SpecConfig, page_size: int, dtype: torch.dtype, target: ModelConfig, world: int = 1
) -> int:
    """Bytes per KV page of the draft model's own cache on a rank of `world` (0 without a draft model: NGRAM, REPLAY
    alone). MTP: one MLA layer of the target's shape."""
    if spec.is_mtp:
        from .mtp import check_has_mtp

        check_has_mtp(target)  # before the target loads
        return page_size * target.kv_cache_dim * dtype.itemsize
    if not spec.draft_model:
        return 0
    from ..models.eagle3 import DraftConfig
    from .eagle3 import draft_page_bytes

    shards = world if draft_is_sharded(spec, world) else 1
    return draft_page_bytes(DraftConfig.from_pretrained(spec.draft_model), page_size, dtype, shards)


def draft_weight_bytes(spec: SpecConfig | None, target: ModelConfig, ranks, dtype: torch.dtype) -> int:
    """The draft weights a rank (`ranks`, a RankInfo) will hold, which load after its KV cache is sized from the
    free memory, so kept out of it: the MTP layer's shard (from the model built on the meta device). EAGLE3 drafts
    (about a GB) and NGRAM: 0, left to the activations' margin."""
    if spec is None or not spec.is_mtp:
        return 0
    from ..models.weight_bytes import mtp_bytes

    return mtp_bytes(target, ranks, dtype)


def draft_memory(spec: SpecConfig | None, page_size: int, dtype: torch.dtype, target: ModelConfig, ranks) -> tuple:
    """What a rank (`ranks`, a RankInfo) sets aside for the draft: (KV bytes per page, weight bytes kept out of the
    cache's budget); (0, 0) without speculation."""
    if spec is None:
        return 0, 0
    pages = draft_kv_page_bytes(spec, page_size, dtype, target, ranks.world_size)
    return pages, draft_weight_bytes(spec, target, ranks, dtype)


def draft_is_sharded(spec: SpecConfig | None, world: int) -> bool:
    """Whether each of `world` > 1 ranks holds a shard of the draft and runs it with rank 0: MTP (a layer of the
    target's own shape), and an EAGLE3 draft whose heads and MLP divide by world (models/eagle3.shardable); an
    EAGLE3 draft that does not runs whole on rank 0, and NGRAM and REPLAY alone have no model."""
    if spec is None or world == 1:
        return False
    if spec.is_mtp:
        return True
    if not spec.draft_model:
        return False
    from ..models.eagle3 import DraftConfig, shardable

    return shardable(DraftConfig.from_pretrained(spec.draft_model), world)


def build_sharded_draft(spec: SpecConfig, runner):
    """Ranks > 0 of a sharded draft (draft_is_sharded): this rank's proposer, which runs rank 0's draft steps."""
    if spec.is_mtp:
        from .mtp import MtpProposer

        return MtpProposer(spec, runner)
    from .eagle3 import Eagle3Proposer

    return Eagle3Proposer(spec, runner)


def build_proposer(spec: SpecConfig, runner):
    """EAGLE3: the draft model. MTP: the target checkpoint's MTP layer. NGRAM: prompt lookup, no model. REPLAY
    (benchmark only): recorded greedy outputs, after the draft's forward if any."""
    if spec.is_ngram:
        from .ngram import NgramProposer

        return NgramProposer(spec, runner)
    if spec.is_mtp:
        from .mtp import MtpProposer

        return MtpProposer(spec, runner)
    inner = None
    if spec.draft_model:
        from .eagle3 import Eagle3Proposer

        inner = Eagle3Proposer(spec, runner)
    if spec.is_replay:
        from .replay import ReplayProposer

        return ReplayProposer(spec, runner, inner)
    return inner
