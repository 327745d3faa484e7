"""Joining the world: --dist-init-addr forms, and two "nodes" (one rank each) meeting through tcp://."""

import threading

import pytest

from mlaserve.config import ParallelConfig
from mlaserve.distributed.launch import launch
from mlaserve.distributed.rendezvous import free_port, init_rank, make_init_args

from . import ranks

TP2 = ParallelConfig(2, 2, 1)


def test_dist_init_addr_forms():
    assert make_init_args(ParallelConfig(dist_init_addr="10.0.0.1:29500")).init_method == "tcp://10.0.0.1:29500"
    assert make_init_args(ParallelConfig(dist_init_addr="env://")).init_method == "env://"
    local = make_init_args(TP2)
    assert local.init_method.startswith("tcp://127.0.0.1:") and local.backend == "gloo"
    assert make_init_args(TP2, device="cuda").backend == "nccl"


def test_bad_local_rank_refused():
    with pytest.raises(ValueError, match=r"local_rank must be in \[0, 2\), got 2"):
        init_rank(2, make_init_args(TP2))


def test_two_nodes_meet_at_dist_init_addr():
    """nnodes=2 with one rank each: global rank = node_rank * local + local_rank; ep over the nodes."""
    addr = f"127.0.0.1:{free_port()}"
    nodes = [ParallelConfig(2, 1, 2, nnodes=2, node_rank=r, dist_init_addr=addr) for r in range(2)]
    out = {}

    def node(r):
        out[r] = launch(nodes[r], ranks.collectives, timeout_s=60, collective_timeout_s=30, start_method="forkserver")

    other = threading.Thread(target=node, args=(1,))
    other.start()
    node(0)
    other.join(60)
    assert out == {0: [(0, 0, 0, 3.0, "from 0")], 1: [(1, 0, 1, 3.0, "from 0")]}


def test_teardown_that_never_returns_is_bounded(monkeypatch):
    """NCCL's teardown after TP under CUDA graphs never returned on two H200s: shutdown_rank gives up after its
    timeout (tp state reset, False returned), and joining another group in this process is refused by name."""
    import time

    from mlaserve.distributed import rendezvous, tp
    from mlaserve.distributed.tp import RankInfo

    hang = threading.Event()
    monkeypatch.setattr(rendezvous.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(rendezvous.dist, "destroy_process_group", hang.wait)  # blocks until the test ends
    tp.set_group(None, RankInfo(rank=1, world_size=2))
    t0 = time.monotonic()
    try:
        assert rendezvous.shutdown_rank(timeout_s=0.2) is False
        assert time.monotonic() - t0 < 5 and tp.rank_info().world_size == 1
        with pytest.raises(RuntimeError, match="teardown did not finish"):
            init_rank(0, make_init_args(TP2))
    finally:
        hang.set()
        tp.set_group(None, RankInfo())


def _quiet_port() -> int:
    return free_port()  # bound and released: nobody listens there


@pytest.mark.parametrize("node_rank, msg", [(1, "rank 1: nobody answered at --dist-init-addr"), (0, "not all 2 ranks")])
def test_dist_init_addr_nobody_answers_times_out_with_a_message(node_rank, msg):
    """A follower whose node 0 never starts, and a node 0 whose followers never come: a TimeoutError after
    --dist-init-timeout that says what to check, not a hang."""
    import time

    from mlaserve.distributed import tp

    addr = f"127.0.0.1:{_quiet_port()}"
    par = ParallelConfig(2, 2, 1, nnodes=2, node_rank=node_rank, dist_init_addr=addr, dist_init_timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"{msg}.* within 1.5 s.*--dist-init-timeout sets the wait"):
        init_rank(0, make_init_args(par))
    assert time.monotonic() - t0 < 15
    assert tp.rank_info().world_size == 1


def test_follower_node_cli_exits_with_the_message(tiny_ckpt):
    """`mlaserve generate` as node 1 of 2 with nobody at --dist-init-addr: exit code 1 and the message."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "mlaserve", "generate", tiny_ckpt, "--prompt", "x", "--device", "cpu", "--tp", "2"]
    cmd += ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{_quiet_port()}"]
    cmd += ["--dist-init-timeout", "2"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, cwd=repo, env={**os.environ, "PYTHONPATH": repo}
    )
    assert out.returncode == 1, out.stderr
    assert "nobody answered at --dist-init-addr" in out.stderr and "within 2 s" in out.stderr


def test_too_few_gpus_refused_naming_the_flags(tiny_ckpt, monkeypatch):
    import torch

    from mlaserve import LLM

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        ValueError, match=r"--tp / --attn-tp-size 2 over --nnodes 1 puts 2 ranks on this machine, which"
    ):
        LLM(tiny_ckpt, device="cuda", tp=2)
