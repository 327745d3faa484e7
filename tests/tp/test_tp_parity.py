"""Two gloo ranks on CPU, fp32: attn-tp2 with moe-tp2 or ep2 give TP1's logits (to ~1e-5) and greedy tokens."""

import pytest
import torch

from mlaserve.config import ParallelConfig
from mlaserve.distributed.launch import launch, spawn_ranks
from mlaserve.distributed.rendezvous import init_rank, make_init_args, shutdown_rank
from mlaserve.distributed.tp import RankInfo

from . import ranks

START = "forkserver"  # ranks fork from a server that imported torch once: a launch costs ~0.1 s, not ~5 s


@pytest.fixture(scope="module")
def checkpoints(tiny_ckpt, tiny_variant):
    """Each checkpoint with its single-process greedy run (tokens, logits per step)."""
    return {path: ranks.greedy(ranks.load(path, RankInfo())[0]) for path in (tiny_ckpt, tiny_variant)}


def assert_same_run(got_tokens, got_logits, want):
    tokens, logits = want
    assert got_tokens == tokens
    assert len(got_logits) == len(logits)
    for step, (a, b) in enumerate(zip(got_logits, logits)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5, msg=lambda m, s=step: f"step {s}: {m}")


def run_all(info, paths, device="cpu"):
    return [ranks.parity(info, p, device) for p in paths]


@pytest.mark.parametrize("sizes", [(2, 2, 1), (2, 1, 2)], ids=["attn-tp2-moe-tp2", "attn-tp2-ep2"])
def test_tp2_matches_tp1(checkpoints, sizes):
    par = ParallelConfig(*sizes)
    paths = list(checkpoints)
    results = launch(par, run_all, paths, timeout_s=180, collective_timeout_s=60, start_method=START)
    assert len(results) == 2
    for rank, per_path in enumerate(results):
        for path, r in zip(paths, per_path):
            assert_same_run(r["tokens"], r["logits"], checkpoints[path])
            assert r["read"] == r["numel"] - (path != paths[0] and rank == 1) * 2 * 64  # minus vocab padding
            assert r["experts_read"] == r["experts_owned"]
            assert len(r["experts_owned"]) == 8 // sizes[2]


def test_engine_shape_rank0_broadcasts_steps(checkpoints, tiny_ckpt):
    """The engine's layout: this process is rank 0 and owns the schedule; it broadcasts each step's chunks and
    the spawned rank 1 follows. Both produce TP1's tokens; the watchdog stays quiet through a clean shutdown."""
    init = make_init_args(ParallelConfig(2, 1, 2), timeout_s=60)
    workers = spawn_ranks(init, ranks.follower, (tiny_ckpt,), local_ranks=[1], start_method=START)
    failures = []
    workers.watch(on_failure=failures.append)
    try:
        info = init_rank(0, init)
        assert (info.rank, info.ep_rank) == (0, 0)
        tokens, logits = ranks.greedy(ranks.load(tiny_ckpt, info)[0], broadcast=True)
    finally:
        shutdown_rank()
        workers.close(timeout=30)
    assert_same_run(tokens, logits, checkpoints[tiny_ckpt])
    assert workers.results == {1: checkpoints[tiny_ckpt][0]}
    assert failures == [] and workers.failure is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_tp2_matches_cpu_tp1(checkpoints):
    """The same runs over NCCL (one GPU per rank, metadata over gloo), against the CPU TP1 reference."""
    paths = list(checkpoints)
    for sizes in [(2, 2, 1), (2, 1, 2)]:
        results = launch(
            ParallelConfig(*sizes), run_all, paths, "cuda", device="cuda", timeout_s=300, collective_timeout_s=120
        )
        for per_path in results:
            for path, r in zip(paths, per_path):
                assert r["tokens"] == checkpoints[path][0]
                for a, b in zip(r["logits"], checkpoints[path][1]):
                    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
