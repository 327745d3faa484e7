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
