"""Ranks > 0: build this rank's model shard and follow rank 0, one broadcast command at a time.

Rank 0 (the engine) broadcasts ("step", decode, prefill) before each forward, ("capture", q_len, max_len)
to capture CUDA graphs together (their collectives must line up), and None to stop.
"""

from __future__ import annotations

import logging

from ..config import EngineConfig, ModelConfig
from . import tp
from .tp import RankInfo

log = logging.getLogger("mlaserve.worker")


def worker_loop(info: RankInfo, engine_cfg: EngineConfig) -> str:
    from ..engine.runner import ModelRunner

    runner = ModelRunner(engine_cfg, ModelConfig.from_pretrained(engine_cfg.model), ranks=info)
    steps = 0
    while True:
        msg = tp.broadcast_object(None)
        if msg is None:
            runner.release_graphs()  # before the group's teardown (ModelRunner.release_graphs)
            return f"rank {info.rank}: {steps} steps"
        if msg[0] == "step":
            runner.execute_local(msg[1], msg[2])
            steps += 1
        elif msg[0] == "capture":
            runner.capture_graphs(*msg[1:])
        else:
            raise RuntimeError(f"rank {info.rank}: unknown command {msg[0]!r} from rank 0")
