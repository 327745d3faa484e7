"""Ranks > 0: build this rank's model shard and follow rank 0, one broadcast command at a time.

Over the host group rank 0 (the engine) broadcasts ("wake",) before a burst of steps, ("capture", q_len, max_len)
to capture CUDA graphs together (their collectives must line up), and None to stop. Awake, the ranks receive each
step as a tensor over the model's group (engine/step_broadcast.py) until rank 0 parks them.
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
            return f"rank {info.rank}: {steps} steps, {runner.graph_steps} by the graph runner"
        if msg[0] == "wake":
            while (step := runner.steps.recv()) is not None:
                runner.execute_local(*step)
                steps += 1
        elif msg[0] == "capture":
            runner.capture_graphs(*msg[1:])
        else:
            raise RuntimeError(f"rank {info.rank}: unknown command {msg[0]!r} from rank 0")
