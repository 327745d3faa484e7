"""Ranks > 0: build this rank's model shard and follow rank 0, one broadcast command at a time.

Over the host group rank 0 (the engine) broadcasts ("wake",) before a burst of steps, ("capture", q_len, max_len)
to capture CUDA graphs together (their collectives must line up), ("capture_draft", ...) for a sharded draft's, and
None to stop. Awake, the ranks receive each step (and each step of a sharded draft) as a tensor over the model's
group (engine/step_broadcast.py) until rank 0 parks them.
"""

from __future__ import annotations

import logging

from ..config import EngineConfig, ModelConfig, SpecConfig
from . import tp
from .tp import RankInfo

log = logging.getLogger("mlaserve.worker")


def worker_loop(info: RankInfo, engine_cfg: EngineConfig, spec: SpecConfig | None = None) -> str:
    from ..engine.runner import ModelRunner, resolve_dtype
    from ..engine.step_broadcast import EagerStep, SuffixStep
    from ..spec.build import build_sharded_draft, draft_is_sharded, draft_memory

    model_cfg = ModelConfig.from_pretrained(engine_cfg.model)
    sharded = draft_is_sharded(spec, info.world_size)
    # the pages rank 0 sizes, its draft's cache beside each (a sharded draft's on every rank)
    dtype = resolve_dtype(engine_cfg.dtype, model_cfg)
    extra, reserve = draft_memory(spec, engine_cfg.page_size, dtype, model_cfg, info)
    runner = ModelRunner(engine_cfg, model_cfg, ranks=info, extra_page_bytes=extra, reserve_bytes=reserve)
    draft = build_sharded_draft(spec, runner) if sharded else None  # this rank's shard of the draft
    steps = 0
    while True:
        msg = tp.broadcast_object(None)
        if msg is None:
            runner.release_graphs()  # before the group's teardown (ModelRunner.release_graphs)
            return f"rank {info.rank}: {steps} steps, {runner.graph_steps} by the graph runner"
        if msg[0] == "wake":
            while (step := runner.steps.recv()) is not None:
                if isinstance(step, tuple):
                    runner.execute_local(*step)
                    steps += 1
                elif isinstance(step, EagerStep):
                    runner.execute_local(step.decode, step.prefill, eager=True)
                    steps += 1
                elif isinstance(step, SuffixStep):
                    runner.execute_local(step.decode, step.prefill, suffix=True)
                    steps += 1
                elif draft is not None:
                    follow_draft(draft, runner.steps, step)
                else:
                    raise RuntimeError(f"rank {info.rank}: a draft step from rank 0, and this rank holds no draft")
        elif msg[0] == "capture":
            runner.capture_graphs(*msg[1:])
        elif msg[0] == "capture_draft" and draft is not None:
            draft.capture_graphs(*msg[1:])
        else:
            raise RuntimeError(f"rank {info.rank}: unknown command {msg[0]!r} from rank 0")


def follow_draft(draft, channel, msg) -> None:
    """Run rank 0's draft step (a DraftMessage; its tensors follow on the channel) on this rank's shard."""
    import torch

    from ..engine.step_broadcast import DRAFT, DRAFT_VERIFIED_SHIFT

    width, dtype = draft.draft.hidden_width, draft.draft.hidden_dtype
    if msg.kind == DRAFT:
        hidden = channel.recv_tensor((sum(len(c.token_ids) for c in msg.chunks), width), dtype)
        draft.extend(msg.chunks, hidden)
        return
    n, N = len(msg.chunks), draft.k + 1
    shifted = msg.kind == DRAFT_VERIFIED_SHIFT
    ints = channel.recv_tensor((n * N + n * (2 if shifted else 1),), torch.int64)
    hidden = channel.recv_tensor((n * N, width), dtype)
    y, acc = ints[: n * N].view(n, N), ints[n * N : n * N + n]
    shift = ints[n * N + n :] if shifted else None
    draft.run_verified(y, acc, hidden, [c.num_cached for c in msg.chunks], [c.pages for c in msg.chunks], shift)
