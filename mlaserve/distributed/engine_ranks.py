"""Start the engine's ranks: node 0 runs rank 0 (scheduler + its shard) in-process and spawns its other local
ranks; other nodes run only followers. Sizes are validated against the model before anything starts."""

from __future__ import annotations

import logging

from ..config import EngineConfig, ModelConfig, ParallelConfig, SpecConfig
from . import tp
from .allreduce import AllReduceConfig
from .launch import RankFailed, Workers, abort, launch, spawn_ranks
from .rendezvous import TEARDOWN_TIMEOUT_S, init_rank, make_init_args, shutdown_rank
from .tp import RankInfo
from .worker import worker_loop

log = logging.getLogger("mlaserve.distributed")
FAILED_TEARDOWN_S = 2.0


def _device(engine_cfg: EngineConfig) -> str:
    import torch

    dev = engine_cfg.device
    return "cuda" if dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available()) else "cpu"


def check_gpus(par: ParallelConfig, device: str) -> None:
    """One rank per GPU: refuse at start a node that has fewer GPUs than ranks, naming the flags."""
    import torch

    n = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and par.local_world_size > n:
        raise ValueError(
            f"--tp / --attn-tp-size {par.world_size} over --nnodes {par.nnodes} puts {par.local_world_size} ranks on "
            f"this machine, which has {n} CUDA GPU(s); each rank needs a GPU of its own"
        )


def start_rank0(
    engine_cfg: EngineConfig,
    par: ParallelConfig,
    model_cfg: ModelConfig,
    on_failure=abort,
    spec: SpecConfig | None = None,
) -> tuple[RankInfo, Workers]:
    """Node 0: spawn local ranks 1.., join as rank 0. A rank that dies calls on_failure (default: exit). spec: the
    engine's speculative decoding (the ranks build their shards of a sharded draft: spec/build.py)."""
    par.validate(model_cfg)
    if par.node_rank != 0:
        raise ValueError("node_rank: only node 0 runs the engine; run followers with run_follower_node")
    check_gpus(par, _device(engine_cfg))
    init = make_init_args(par, _device(engine_cfg), allreduce=AllReduceConfig.from_kernels(engine_cfg.kernels))
    workers = spawn_ranks(init, worker_loop, (engine_cfg, spec), local_ranks=range(1, par.local_world_size))
    workers.watch(on_failure)
    try:
        info = init_rank(0, init)
    except BaseException:
        workers.close(timeout=1)
        raise
    if par.nnodes > 1 and tp.store() is not None:  # the other machines' ranks: by their heartbeats
        workers.watch_remote(tp.store(), list(range(par.local_world_size, par.world_size)))
    log.info(
        "rank 0 of %d joined (attn-tp %d, moe-tp %d, ep %d)",
        par.world_size,
        par.attn_tp_size,
        par.moe_tp_size,
        par.ep_size,
    )
    return info, workers


def stop_rank0(workers: Workers) -> None:
    """After rank 0 told the others to stop: leave the group while they leave theirs (a teardown that needs every
    rank finds them there), then reap them. Each teardown is bounded (rendezvous.TEARDOWN_TIMEOUT_S); after a rank
    died (the others were terminated) nobody is left to meet, so rank 0 waits only briefly."""
    shutdown_rank(FAILED_TEARDOWN_S if workers.failure is not None else TEARDOWN_TIMEOUT_S)
    workers.close()


def abandon_rank0(workers: Workers) -> None:
    """Rank 0 gives up (its engine failed to start, or a rank died): end the other ranks, then leave the group."""
    workers.close(timeout=0)
    shutdown_rank(FAILED_TEARDOWN_S)


def run_follower_node(engine_cfg: EngineConfig, par: ParallelConfig, spec: SpecConfig | None = None) -> int:
    """Nodes > 0: run every local rank as a follower until rank 0 says stop; 1 with the message if one dies."""
    par.validate(ModelConfig.from_pretrained(engine_cfg.model))
    check_gpus(par, _device(engine_cfg))
    try:
        allreduce = AllReduceConfig.from_kernels(engine_cfg.kernels)
        launch(par, worker_loop, engine_cfg, spec, device=_device(engine_cfg), allreduce=allreduce)
    except RankFailed as e:
        log.error("%s\n%s", e, e.details)
        return 1
    return 0
