"""Server fixtures: the real app on uvicorn on a free loopback port in a background thread, the same model offline
as the reference for greedy outputs, and the "nothing leaked" check (engine pool and /metrics)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from mlaserve import LLM
from mlaserve.bench.metrics import parse_prometheus
from mlaserve.server.api import Server
from mlaserve.server.guard import HTTPLimits

ENGINE_KW = dict(device="cpu", num_pages=512, page_size=16)


@dataclass
class Running:
    url: str
    server: Server
    llm: LLM
    thread: threading.Thread
    result: dict

    @property
    def engine(self):
        return self.llm.engine

    def stop(self, timeout: float = 30) -> int | None:
        self.server.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server did not stop"
        return self.result.get("rc")


def start_server(
    model: str,
    name: str = "tiny",
    max_request_bytes: int = 4 << 20,
    chat_options=None,
    limits: HTTPLimits | None = None,
    **engine_kw,
) -> Running:
    llm = LLM(model, **{**ENGINE_KW, **engine_kw})
    server = Server(
        llm.engine,
        name,
        max_request_bytes=max_request_bytes,
        log_level="warning",
        chat_options=chat_options,
        limits=limits or HTTPLimits(),
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    result: dict = {}

    def run():
        result["rc"] = server.run(sockets=[sock])
        sock.close()

    thread = threading.Thread(target=run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.uvicorn.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.uvicorn.started, "the server did not start"
    return Running(f"http://127.0.0.1:{sock.getsockname()[1]}", server, llm, thread, result)


@pytest.fixture(scope="session")
def server(tiny_ckpt):
    """The tiny model served for the whole session (tests share it: each leaves it idle and leak-free)."""
    run = start_server(tiny_ckpt)
    yield run
    assert run.stop() == 0


@pytest.fixture(scope="session")
def offline(tiny_ckpt):
    """The same checkpoint through mlaserve.LLM: the reference for every greedy output."""
    return LLM(tiny_ckpt, **ENGINE_KW)


def greedy_ids(llm: LLM, prompt, max_tokens: int, **kw) -> list[int]:
    from mlaserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return llm.generate([prompt], sp, use_tqdm=False)[0].token_ids


def scrape(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text)


def assert_idle_no_leak(run: Running, timeout: float = 30) -> dict[str, float]:
    """Wait until the server is idle, then: no request left, the page pool consistent, every page free (cached
    prefix pages count as free: evictable), and /metrics agreeing. Returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(run.url)
        idle = (
            m["mlaserve:num_requests_running"] == 0
            and m["mlaserve:num_requests_waiting"] == 0
            and m["mlaserve:kv_cache_pages_used"] == 0
        )
        if idle and not run.engine.has_unfinished() and not run.server.async_engine._live:
            break
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {m}"
        time.sleep(0.05)
    pool = run.engine.pool
    pool.check()
    assert pool.num_used == 0 and pool.num_free == pool.num_pages, f"{pool.num_used} KV pages leaked"
    return m
