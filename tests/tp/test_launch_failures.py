"""A rank that raises, dies or hangs fails the launch fast with a clear message; nothing waits forever."""

import os
import subprocess
import sys
import time

import pytest
import torch

from mlaserve.config import ParallelConfig
from mlaserve.distributed import launch as launch_mod
from mlaserve.distributed import tp
from mlaserve.distributed.launch import RankFailed, launch, spawn_ranks
from mlaserve.distributed.rendezvous import init_rank, make_init_args, shutdown_rank

from . import ranks

TP2 = ParallelConfig(2, 2, 1)


def failing_launch(how: str, start_method: str = "forkserver", collective_timeout_s: float = 60):
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as e:
        launch(
            TP2, ranks.crash, how, timeout_s=120, collective_timeout_s=collective_timeout_s, start_method=start_method
        )
    return e.value, time.monotonic() - t0


def test_rank_that_raises_fails_the_launch_spawn():
    """The production start method: fresh interpreters (so this one pays the imports: seconds)."""
    err, took = failing_launch("raise", start_method="spawn")
    assert str(err) == "rank 1 exited with code 1: RuntimeError: rank 1 fails on purpose"
    assert err.account == "rank 1 exited with code 1: it raised an error"  # what a client reads: no error text
    assert (err.rank, err.exitcode) == (1, 1)
    assert "--- rank 1 (exit code 1) ---" in err.details and "fails on purpose" in err.details
    assert took < 60


def test_rank_killed_by_a_signal():
    err, took = failing_launch("kill")
    assert str(err).startswith("rank 1 exited with code -9 (SIGKILL): no Python exception was reported")
    assert err.account == str(err)
    assert took < 10  # rank 0, blocked in an all-reduce with the dead peer, is not waited for


def test_hung_peer_times_out_the_collective():
    """Rank 1 sleeps instead of joining the all-reduce; rank 0's collective times out and names the cause."""
    err, took = failing_launch("hang", collective_timeout_s=2)
    assert str(err).startswith("rank 0 exited with code 1: ")
    assert "timed out" in str(err).lower() or "timeout" in str(err).lower()
    assert took < 20


def test_watchdog_when_this_process_is_rank0():
    """The engine's layout: rank 1 (spawned) dies while rank 0 (here) is in a collective. The collective errors
    out instead of hanging, and the watchdog reports rank 1's own error."""
    init = make_init_args(TP2, timeout_s=30)
    workers = spawn_ranks(init, ranks.crash, ("raise",), local_ranks=[1], start_method="forkserver")
    failures = []
    workers.watch(on_failure=failures.append)
    try:
        init_rank(0, init)
        tp.all_reduce(torch.ones(4))
        with pytest.raises(RuntimeError):
            tp.all_reduce(torch.ones(4))  # the peer is gone: gloo sees the closed connection
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        shutdown_rank()
        workers.close(timeout=5)
    assert [str(f) for f in failures] == ["rank 1 exited with code 1: RuntimeError: rank 1 fails on purpose"]
    assert tp.rank_info().world_size == 1


def test_abort_says_why_and_exits(monkeypatch, capsys):
    codes = []
    monkeypatch.setattr(launch_mod.os, "_exit", codes.append)
    launch_mod.abort(RankFailed("rank 3 exited with code -9 (SIGKILL): ...", 3, -9, "--- rank 3 ---\n"))
    assert codes == [1]
    assert "mlaserve: rank 3 exited with code -9 (SIGKILL)" in capsys.readouterr().err


def test_clean_close_leaks_no_semaphore():
    """Ranks leave by os._exit (no interpreter teardown), which skips the finalizer of tqdm's default
    multiprocessing lock: the resource tracker then warned of a leaked semaphore at every TP close."""
    code = (
        "from mlaserve.config import ParallelConfig\n"
        "from mlaserve.distributed.launch import launch\n"
        "from tests.tp import ranks\n"
        "print(launch(ParallelConfig(2, 2, 1), ranks.progress_bar, timeout_s=120, start_method='spawn'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 1]"
    assert "leaked" not in out.stderr, out.stderr


class _Dying:
    """A process whose exit code appears between two reads (reaped while the watchdog looks at it)."""

    def __init__(self):
        r, w = os.pipe()
        os.close(w)  # the sentinel reads as ready: the process is ending
        self.sentinel, self.reads = r, 0

    @property
    def exitcode(self):
        self.reads += 1
        return None if self.reads == 1 else -9

    def join(self, timeout=None):
        pass


def test_a_rank_reaped_mid_check_is_a_failure():
    dying = _Dying()
    workers = launch_mod.Workers(None, {1: dying}, {}, [])
    try:
        with pytest.raises(RankFailed, match=r"rank 1 exited with code -9 \(SIGKILL\)"):
            workers.wait(timeout=10)
    finally:
        os.close(dying.sentinel)
