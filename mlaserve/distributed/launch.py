"""One process per rank, each running `target(rank_info, *args)`; a rank that dies fails everything fast.

Node 0's rank 0 may be the calling process (the engine's scheduler lives there; it calls `init_rank(0, ...)`
itself) while `spawn_ranks` starts the others. A rank that dies becomes one
`RankFailed("rank N exited with code C: <its last error>")`, never a hang.

The target contract: a module-level function, called once the rank has joined (tp's collectives work, the
CUDA device is the local rank's); it loops as long as it likes (the engine's: receive a step with
engine.step_broadcast, run the model, until rank 0 says stop); its return value, picklable, goes to the
launcher; an exception ends the rank and fails the launch with its message.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from tqdm import tqdm

from ..config import ParallelConfig
from .allreduce import AllReduceConfig
from .heartbeat import watch_beats
from .rendezvous import InitArgs, init_rank, make_init_args, shutdown_rank

log = logging.getLogger("mlaserve.distributed")

GRACE_S = 1.0  # after a first failure, how long to wait for the others' reports (to name the root cause)
POLL_S = 1.0  # exit codes are also polled this often: a process's pipes may outlive it (a child holding them)


class RankFailed(RuntimeError):
    """A rank exited abnormally or raised; `rank`, `exitcode`, and every failed rank's traceback in `details`.
    `account`: what a client may read (which rank, how it ended), without the rank's own error text (paths)."""

    def __init__(
        self, message: str, rank: int = -1, exitcode: int | None = None, details: str = "", account: str | None = None
    ):
        super().__init__(message)
        self.rank, self.exitcode, self.details = rank, exitcode, details
        self.account = message if account is None else account


def _exit_with_parent(alive: Connection) -> None:
    """A spawned rank whose launcher died exits at once, rather than waiting forever in a collective.
    The launcher holds the other end of `alive` and never writes: it reads as ready only at EOF."""

    def watch():
        wait([alive])
        sys.stderr.write(f"mlaserve rank (pid {os.getpid()}): the launching process died; exiting\n")
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()


def run_worker(
    local_rank: int, init: InitArgs, target: Callable, args: tuple, conn: Connection, alive: Connection
) -> None:
    """A spawned rank's entry point: join, run `target(rank_info, *args)`, send ("ok", result) or
    ("error", time, message, traceback) to the launcher over `conn`."""
    _exit_with_parent(alive)
    # tqdm's default lock is a multiprocessing semaphore whose cleanup is a finalizer, which os._exit below skips:
    # the resource tracker would report it leaked at every close. A rank's bars need only a thread lock.
    tqdm.set_lock(threading.RLock())
    rank = init.parallel.global_rank(local_rank)
    try:
        result = target(init_rank(local_rank, init), *args)
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as e:  # every failure, SystemExit included, must reach the launcher
        tb = traceback.format_exc()
        sys.stderr.write(f"[mlaserve rank {rank}] {tb}")
        sys.stderr.flush()
        try:
            conn.send_bytes(pickle.dumps(("error", time.time(), f"{type(e).__name__}: {e}", tb)))
        finally:
            os._exit(1)  # no teardown: destroying a group with a dead peer can block
    shutdown_rank()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalization: seconds with torch loaded, and nothing left to clean


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


class Workers:
    """The spawned ranks of this node. `wait` (or the `watch` thread, not both) collects their results
    (`results`, by global rank) and turns the first abnormal exit into RankFailed."""

    def __init__(
        self, init: InitArgs, procs: dict[int, mp.Process], conns: dict[int, Connection], alive: list[Connection]
    ):
        self.init, self.procs, self._conns, self._alive = init, procs, conns, alive
        self.results: dict[int, object] = {}
        self.errors: dict[int, tuple] = {}  # rank -> (time, message, traceback)
        self.failure: RankFailed | None = None  # set by the watch thread
        self._first_failure: float | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self.on_failure: Callable[[RankFailed], None] | None = None  # watch's handler; replaceable while it runs
        self._remote_stop = threading.Event()

    def _read(self, rank: int) -> None:
        conn = self._conns.pop(rank)
        try:
            kind, *rest = pickle.loads(conn.recv_bytes())
        except EOFError:  # exited without reporting
            return
        finally:
            conn.close()
        if kind == "ok":
            self.results[rank] = rest[0]
        else:
            self.errors[rank] = tuple(rest)

    def _exit_codes(self) -> dict[int, int | None]:
        """One snapshot per decision: a rank reaped between two reads of its exit code must not look alive to one
        and gone to the other (a killed rank would pass for a clean exit)."""
        return {r: p.exitcode for r, p in self.procs.items()}

    def _failed(self, codes: dict[int, int | None]) -> list[int]:
        """Ranks that raised, exited non-zero, or exited 0 without returning."""
        return [
            r
            for r, code in codes.items()
            if r in self.errors
            or code not in (None, 0)
            or (code == 0 and r not in self.results and r not in self._conns)
        ]

    def wait(self, timeout: float | None = None) -> dict[int, object]:
        """Results by global rank once every rank returned; RankFailed at the first failure (after GRACE_S to
        collect the others' reports); TimeoutError (ranks terminated) after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            codes = self._exit_codes()
            if self._first_failure is None and self._failed(codes):
                self._first_failure = now
            alive = [r for r, code in codes.items() if code is None]
            if self._first_failure is not None and (not alive or now >= self._first_failure + GRACE_S):
                raise self._fail()
            if not alive and not self._conns:
                return dict(sorted(self.results.items()))
            if deadline is not None and now >= deadline and self._first_failure is None:
                self.terminate()
                raise TimeoutError(f"ranks {alive} did not finish within {timeout} s; terminated them")
            wake = [t for t in (deadline, self._first_failure and self._first_failure + GRACE_S) if t is not None]
            waiting = {self.procs[r].sentinel: r for r in alive}
            waiting.update({c: r for r, c in self._conns.items()})
            for obj in wait(list(waiting), min(max(min(wake) - now, 0.0) if wake else POLL_S, POLL_S)):
                if isinstance(obj, Connection):
                    self._read(waiting[obj])
                else:  # a sentinel: the process is ending; reap it (its exit code is read on the next pass)
                    self.procs[waiting[obj]].join(POLL_S)

    def _fail(self) -> RankFailed:
        """Name the root cause: a rank killed without a report first (its peers' errors follow from it),
        else the earliest reported exception."""
        for r in [r for r, c in self._conns.items() if c.poll()]:
            self._read(r)  # reports already sent
        failed = self._failed(self._exit_codes())
        silent = [r for r in failed if r not in self.errors]
        rank = silent[0] if silent else min(failed, key=lambda r: self.errors[r][0])
        self.terminate()
        code = self.procs[rank].exitcode
        why = (
            self.errors[rank][1]
            if rank in self.errors
            else ("no Python exception was reported (killed by a signal, out of memory, or os._exit); see its stderr")
        )
        details = "\n".join(
            f"--- rank {r} (exit code {_describe_exit(self.procs[r].exitcode)}) ---\n"
            + (self.errors[r][2] if r in self.errors else "no traceback\n")
            for r in failed
        )
        head = f"rank {rank} exited with code {_describe_exit(code)}"
        account = f"{head}: it raised an error" if rank in self.errors else f"{head}: {why}"
        return RankFailed(f"{head}: {why}", rank, code, details, account)

    def terminate(self) -> None:
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()
        for p in self.procs.values():
            p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join()
        alive, self._alive = self._alive, []  # the watch thread may get here too (close after a timeout)
        for c in alive:
            try:
                c.close()
            except OSError:
                pass

    def watch(self, on_failure: Callable[[RankFailed], None] | None = None) -> threading.Thread:
        """Watch the ranks from a daemon thread (for a launcher that is itself rank 0 and busy running it):
        the first failure is stored in `self.failure` and, unless `close` was called, passed to `self.on_failure`
        (on_failure, or whatever replaced it since; default `abort`: exit with the message)."""
        self.on_failure = on_failure or abort

        def run():
            try:
                self.wait()
            except RankFailed as e:
                self.failure = e
                if not self._closing:
                    self.on_failure(e)

        self._thread = threading.Thread(target=run, daemon=True, name="rank-watchdog")
        self._thread.start()
        return self._thread

    def watch_remote(self, store, ranks: list[int]) -> None:
        """Ranks on other machines (heartbeat.py): one whose heartbeat stops fails like a local rank that exits."""

        def dead(rank: int, silent: float) -> None:
            if self.failure is None and not self._closing:
                self.failure = RankFailed(
                    f"rank {rank} (on another machine) stopped answering: no heartbeat for {silent:.0f} s", rank
                )
                self.on_failure(self.failure)

        watch_beats(store, ranks, dead, self._remote_stop)

    def close(self, timeout: float = 10.0) -> None:
        """Shut down: give the ranks `timeout` seconds to return (rank 0 has told them to stop), then
        terminate the rest. Failures from here on are expected and not reported."""
        self._closing = True
        self._remote_stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            try:
                self.wait(timeout)
            except (RankFailed, TimeoutError) as e:
                log.warning("while closing the ranks: %s", e)
        self.terminate()


def abort(e: RankFailed) -> None:
    """The server's reaction to a dead rank: say why on stderr and exit this process now. The main thread
    may be blocked inside a collective with the dead peer, so nothing gentler is sure to end."""
    sys.stderr.write(f"mlaserve: {e}\n{e.details}")
    sys.stderr.flush()
    log.critical("%s", e)
    os._exit(1)


def spawn_ranks(
    init: InitArgs, target: Callable, args: tuple = (), local_ranks=None, start_method: str = "spawn"
) -> Workers:
    """Start one process per local rank (default: all of this node's; node 0's engine passes range(1, n)
    and runs rank 0 itself). `target` must be importable by name (a module-level function).
    start_method "forkserver" (CPU only) forks ranks from a server that imported torch once: far faster
    to start when launching repeatedly (tests)."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    local_ranks = range(init.parallel.local_world_size) if local_ranks is None else local_ranks
    procs, conns, alive = {}, {}, []
    for lr in local_ranks:
        rank = init.parallel.global_rank(lr)
        recv, send = ctx.Pipe(duplex=False)
        alive_r, alive_w = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=run_worker, args=(lr, init, target, args, send, alive_r), daemon=True, name=f"mlaserve-rank{rank}"
        )
        p.start()
        send.close()  # the child holds the only writer: EOF once it exits
        alive_r.close()
        procs[rank], conns[rank] = p, recv
        alive.append(alive_w)  # kept open for the launcher's lifetime
        log.info("started rank %d as pid %d", rank, p.pid)
    return Workers(init, procs, conns, alive)


def launch(
    par: ParallelConfig,
    target: Callable,
    *args,
    device: str = "cpu",
    timeout_s: float | None = None,
    collective_timeout_s: float = 600.0,
    start_method: str = "spawn",
    allreduce: AllReduceConfig | None = None,
) -> list:
    """Run target(rank_info, *args) on every local rank in its own process; their return values, by rank.
    Raises RankFailed as soon as one rank fails, TimeoutError after `timeout_s`."""
    init = make_init_args(par, device, collective_timeout_s, allreduce)
    workers = spawn_ranks(init, target, args, start_method=start_method)
    try:
        return list(workers.wait(timeout_s).values())
    finally:
        workers.terminate()
