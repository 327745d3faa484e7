"""AsyncEngine: the LLMEngine runs in its own thread; HTTP handlers submit requests and await their events.

The HTTP event loop never waits on a step. Adds and aborts are commands the engine thread applies between
steps; each step's outputs go back to the event loop in one call_soon_threadsafe. An add is acknowledged
(or refused with the engine's ValueError / OverflowError) before the handler answers, so a refusal is always
a proper HTTP error, never a broken stream.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ..engine.engine import LLMEngine, StepOutput
from ..types import SamplingParams
from .internal_errors import log_internal_error, new_error_id
from .metrics import Metrics

log = logging.getLogger("mlaserve.server")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (a failed step, or shutdown): no request can be served. `public`: clients may
    read the message (a dead rank's account, which /health shows too); otherwise a 500 carries an error id only."""

    def __init__(self, message: str, public: bool = False):
        super().__init__(message)
        self.public = public


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if not fut.done():  # the handler may have given up waiting (client gone)
        fut.set_exception(exc) if exc is not None else fut.set_result(None)


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """call_soon_threadsafe from the engine thread; False when the loop is closed (the server has stopped)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


class Generation:
    """The engine requests of one HTTP request (one per prompt): iterate (prompt index, StepOutput) as steps
    produce them (StepOutput.index: the choice, n > 1). abort() frees every unfinished one at once; call it when the
    consumer stops early."""

    def __init__(self, owner: AsyncEngine, request_ids: list[str], loop: asyncio.AbstractEventLoop, n: int = 1):
        self.owner, self.request_ids, self.loop = owner, request_ids, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()
        self.unfinished = {rid: n for rid in request_ids}  # request id -> choices still running

    def __aiter__(self) -> AsyncIterator[tuple[int, StepOutput]]:
        return self._events()

    async def _events(self):
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.unfinished.clear()  # the engine is gone: nothing left to abort
                raise item
            index, out = item
            if out.finished and out.request_id in self.unfinished:
                self.unfinished[out.request_id] -= 1
                if not self.unfinished[out.request_id]:
                    del self.unfinished[out.request_id]
            yield index, out

    def abort(self) -> None:
        if self.unfinished:
            self.owner._submit(("abort", list(self.unfinished)))
            self.unfinished.clear()


@dataclass
class _Live:
    """Engine-thread record of one running engine request."""

    gen: Generation
    index: int
    arrival: float
    first_token: float | None = None
    remaining: int = 1  # choices still running (n)


class AsyncEngine:
    """root_cause(error) -> the error to report for a failed step (the server's: a dead rank's RankFailed, when the
    step failed on a collective with it)."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: Metrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        root_cause: Callable[[BaseException], BaseException] | None = None,
    ):
        self.engine, self.metrics, self.on_fatal, self.root_cause = engine, metrics, on_fatal, root_cause
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        # orders submits against the thread's death (no command is orphaned), and guards _live, which a failure
        # reported from another thread (fail) settles
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}
        self._stop = False
        self.error: BaseException | None = None
        self.error_id: str | None = None  # the log holds self.error under this id
        self._thread = threading.Thread(target=self._loop, name="mlaserve-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def stopped_message(self) -> str:
        """Why no request can be served, for clients: a dead rank's account (no paths, no exception text) or a
        generic message, with the id the log holds the error under."""
        if self.error is None:
            return "the engine has stopped (the server is shutting down)"
        ref = f"internal error {self.error_id}: the server log holds the details under this id"
        account = getattr(self.error, "account", None)
        return f"the engine has stopped: {account}; {ref}" if account else f"the engine has stopped; {ref}"

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        # a failed engine's thread may be stuck in a collective with a dead rank: do not wait for it
        self._thread.join(timeout=30 if self.error is None else 1)

    def fail(self, error: BaseException) -> None:
        """From any thread: the engine cannot go on (a rank died). Every queued and running request fails with error,
        new ones are refused; the engine thread stops at its next turn, if it is not stuck in a step. error becomes the
        engine's error even if a step failed first (on a collective with the dead rank: error is the cause)."""
        eid = new_error_id()
        log_internal_error(eid, "a tensor-parallel rank failed", error)
        account = getattr(error, "account", None) or "a tensor-parallel rank failed"
        self._fail(error, EngineDeadError(f"the engine failed: {account}", public=True), cause=True, error_id=eid)
        self._wake.set()

    # ---- called from the HTTP event loop -------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (bad input), OverflowError (queue full) or EngineDeadError before anything is queued."""
        if not self.healthy:
            raise EngineDeadError(self.stopped_message(), public=True)
        self.engine.validate(prompt_ids, params)

    async def generate(self, prompts: list[list[int]], params: SamplingParams, request_id: str) -> Generation:
        """Queue one engine request per prompt, all or none; returns once the engine thread has accepted them."""
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        gen = Generation(self, ids, asyncio.get_running_loop(), params.n)
        self._submit(("add", gen, prompts, params, time.monotonic()))
        try:
            await gen.accepted
        except BaseException:
            gen.abort()  # cancelled while waiting (client gone): the add may still land; this abort follows it
            raise
        return gen

    async def reset_prefix_cache(self) -> int | None:
        """The engine thread forgets every cached prefix between steps -> the pages freed, or None while requests
        are unfinished (LLMEngine.reset_prefix_cache)."""
        fut = asyncio.get_running_loop().create_future()
        self._submit(("reset", fut))
        return await fut

    def _submit(self, cmd: tuple) -> None:
        with self._lock:
            if self.error is not None or self._stop:
                if cmd[0] != "abort":
                    raise EngineDeadError(self.stopped_message(), public=True)
                return  # an abort after death: nothing is running
            self._cmds.put(cmd)
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------------------
    def _add(self, gen: Generation, prompts: list[list[int]], params: SamplingParams, arrival: float) -> None:
        eng = self.engine
        try:
            for ids in prompts:  # all or none: refuse the lot before queueing any
                eng.validate(ids, params)
            held = eng.scheduler.num_unfinished
            if held + len(prompts) * params.num_seqs > eng.cfg.max_queue_len:
                raise OverflowError(
                    f"the engine holds {held} requests; {len(prompts) * params.num_seqs} more exceed max_queue_len "
                    f"{eng.cfg.max_queue_len}"
                )
            for i, (rid, ids) in enumerate(zip(gen.request_ids, prompts)):
                eng.add_request(ids, params, request_id=rid)
                with self._lock:
                    self._live[rid] = _Live(gen, i, arrival, remaining=params.n)
        except Exception as e:  # noqa: BLE001 - any refusal belongs to this request, never to the engine
            for rid in gen.request_ids:
                with self._lock:
                    live = self._live.pop(rid, None)
                if live is not None:
                    eng.abort_request(rid)
            _call(gen.loop, _settle, gen.accepted, e)
            return
        if not _call(gen.loop, _settle, gen.accepted, None):
            self._abort(gen.request_ids)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "reset":
                fut = cmd[1]
                _call(fut.get_loop(), _resolve, fut, self.engine.reset_prefix_cache())
            else:
                self._abort(cmd[1])

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            with self._lock:
                self._live.pop(rid, None)
            if self.engine.abort_request(rid) and self.metrics:
                self.metrics.observe_abort()

    def _deliver(self, outs: list[StepOutput]) -> None:
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for o in outs:
            with self._lock:
                live = self._live.get(o.request_id)
                if live is not None and o.finished:
                    live.remaining -= 1
                    if not live.remaining:
                        del self._live[o.request_id]
            if live is None:
                continue
            if live.first_token is None and o.new_token_ids:
                live.first_token = now
            by_loop.setdefault(live.gen.loop, []).append((live.gen.queue, (live.index, o)))
            if o.finished and not live.remaining:  # the request's last choice: its usage counts them all
                if self.metrics:
                    ttft = None if live.first_token is None else live.first_token - live.arrival
                    self.metrics.observe_finished(o.finish_reason, o.usage, ttft, now - live.arrival)
        for loop, items in by_loop.items():  # one wake-up of the event loop per step
            if not _call(loop, _put_all, items):  # nobody is listening any more: free their pages
                with self._lock:
                    gone = [rid for rid, live in self._live.items() if live.gen.loop is loop]
                self._abort(gone)

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._apply_commands()
                if self.engine.has_unfinished():
                    steps = self.engine.num_steps
                    outs = self.engine.step()
                    if self.metrics:  # before the outputs go out: a client that saw its last token sees the counts
                        self.metrics.observe_engine(self.engine.stats())
                    self._deliver(outs)
                    if not outs and self.engine.num_steps == steps:  # nothing was schedulable: do not spin
                        self._wake.wait(timeout=0.001)
                        self._wake.clear()
                else:
                    self.engine.runner.park()  # TP: idle ranks wait on the host group, not in a collective
                    if self.metrics:
                        self.metrics.observe_engine(self.engine.stats())
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:  # a bug or a dead TP rank: fail every waiter loudly, never hang
            cause = self.root_cause(e) if self.root_cause is not None else e
            eid = new_error_id()
            log_internal_error(eid, f"engine step failed{'' if cause is e else f' ({cause!r})'}; going down", e)
            # a step that failed on a collective with a dead rank reports that rank (root_cause), a public account;
            # any other failure: the client's 500 carries an error id only (internal_errors.py)
            account = getattr(cause, "account", None)  # a RankFailed's
            err = EngineDeadError(f"the engine failed: {account or repr(cause)}", public=account is not None)
            self._fail(cause, err, error_id=eid)
            if self.on_fatal:
                self.on_fatal(cause)
            return
        self._fail(None, EngineDeadError("the server is shutting down", public=True))

    def _fail(
        self, error: BaseException | None, err: EngineDeadError, cause: bool = False, error_id: str | None = None
    ) -> None:
        """Settle every queued add and every live request with `err`; later submits are refused. The first error
        reported stays the engine's error (logged under error_id), unless `cause`."""
        with self._lock:
            if cause or self.error is None:
                self.error, self.error_id = error, error_id
            self._stop = True
            live, self._live = list(self._live.values()), {}
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                _call(cmd[1].loop, _settle, cmd[1].accepted, err)
            elif cmd[0] == "reset":
                _call(cmd[1].get_loop(), _settle, cmd[1], err)
        for x in live:
            _call(x.gen.loop, x.gen.queue.put_nowait, err)


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)
