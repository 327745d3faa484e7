"""AsyncEngine: the LLMEngine runs in its own thread; HTTP handlers submit requests and await their events.

The HTTP event loop never waits on a step. Adds and aborts are commands the engine thread applies between
steps; each step's outputs go back to the waiting coroutine with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from ..engine.engine import LLMEngine, StepOutput
from ..types import SamplingParams
from .metrics import Metrics

log = logging.getLogger("mlaserve.server")


class EngineDeadError(RuntimeError):
    pass


class _Sink:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.arrival = time.monotonic()
        self.first_token: float | None = None

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, metrics: Metrics | None = None, on_fatal: Callable[[BaseException], None] | None = None
    ):
        self.engine, self.metrics, self.on_fatal = engine, metrics, on_fatal
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="mlaserve-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- called from the HTTP event loop -------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (bad input) or OverflowError (queue full) before anything is queued."""
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        self.engine.validate(prompt_ids, params)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[StepOutput]:
        """Yield one StepOutput per engine step that produced tokens for this request; aborts if abandoned."""
        self.validate(prompt_ids, params)
        sink = _Sink(asyncio.get_running_loop())
        self._cmds.put(("add", request_id, prompt_ids, params, sink))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the client went away, or the handler failed: free the pages now
                self._cmds.put(("abort", request_id))
                self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, sink = cmd
                try:
                    self.engine.add_request(ids, params, request_id=rid)
                    self._sinks[rid] = sink
                except (ValueError, OverflowError) as e:  # raced past validate (e.g. the queue filled up)
                    sink.put(e)
            else:
                self.engine.abort_request(cmd[1])
                self._sinks.pop(cmd[1], None)

    def _deliver(self, outs: list[StepOutput]) -> None:
        now = time.monotonic()
        for o in outs:
            sink = self._sinks.get(o.request_id)
            if sink is None:
                continue
            if sink.first_token is None and o.new_token_ids:
                sink.first_token = now
            sink.put(o)
            if o.finished:
                del self._sinks[o.request_id]
                if self.metrics:
                    ttft = None if sink.first_token is None else sink.first_token - sink.arrival
                    self.metrics.observe_finished(o.finish_reason, o.usage, ttft, now - sink.arrival)

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._apply_commands()
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                    if self.metrics:
                        self.metrics.observe_engine(self.engine.stats())
                else:
                    if self.metrics:
                        self.metrics.observe_engine(self.engine.stats())
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:  # a bug or a dead TP rank: fail every waiter loudly, never hang
            log.exception("engine step failed; the server is going down")
            self.error = e
            err = EngineDeadError(f"the engine failed: {e!r}")
            for sink in self._sinks.values():
                sink.put(err)
            self._sinks.clear()
            if self.on_fatal:
                self.on_fatal(e)
