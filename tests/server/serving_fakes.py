"""Stand-ins for what server/serving.py talks to (the AsyncEngine and its LLM, the tokenizer, an HTTP request), so its
steps are tested alone, without a model or a server."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from starlette.requests import ClientDisconnect

from mlaserve.engine.kv_pool import KVPool
from mlaserve.server.serving import ServingContext


class Tok:
    """A tokenizer whose answers show what it was asked."""

    has_chat_template = True

    def __init__(self):
        self.template_calls: list[tuple] = []
        self.encode_threads: list[bool] = []  # per encode: did it run on the main thread
        self.template_error: Exception | None = None
        vocabs = {True: {"a": 0, "bcd": 1, "<|im|>": 2}, False: {"a": 0, "bcd": 1}}
        self.backend = SimpleNamespace(get_vocab=lambda with_added_tokens: vocabs[with_added_tokens])

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.encode_threads.append(threading.current_thread() is threading.main_thread())
        return [len(text), int(add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return f"<{ids[0]}:{skip_special_tokens}>"

    def apply_chat_template(self, messages, add_generation_prompt, **kwargs) -> str:
        if self.template_error is not None:
            raise self.template_error
        self.template_calls.append((messages, add_generation_prompt, kwargs))
        return "PROMPT"


class Engine:
    """The AsyncEngine: validate() and generate() recorded, each failing with `fail` when set."""

    def __init__(self, tok: Tok | None, model: str = "", max_queue_len: int = 2, spec_k: int = 0):
        self.calls: list[tuple] = []
        self.fail: Exception | None = None
        self.metrics = object()
        grammars = SimpleNamespace(compile=lambda spec: self.calls.append(("compile", spec)))
        cfg = SimpleNamespace(model=model, max_queue_len=max_queue_len)
        # 3 pages of 4 tokens: 11 prompt tokens (+ 1 generated) fit, 12 do not
        self.engine = SimpleNamespace(
            tokenizer=tok, cfg=cfg, max_model_len=20, pool=KVPool(3, 4), grammars=grammars, spec_k=spec_k
        )

    def validate(self, ids, params) -> None:
        self.calls.append(("validate", ids))
        if self.fail is not None:
            raise self.fail

    async def generate(self, prompts, params, request_id):
        self.calls.append(("generate", prompts, request_id))
        return "GEN"


def context(tok: Tok | None = None, max_request_bytes: int = 10, **engine_kw) -> ServingContext:
    return ServingContext(Engine(tok, **engine_kw), "tiny", max_request_bytes)


class HTTPRequest:
    """A request whose body arrives in `parts` (a ClientDisconnect instance among them: the client leaves there)."""

    def __init__(self, parts: list, headers: dict | None = None, messages: list[dict] | None = None):
        self.parts, self.headers = parts, headers or {}
        self.messages = list(messages or [])  # what receive() returns in turn; then it waits forever

    async def stream(self):
        for p in self.parts:
            if isinstance(p, Exception):
                raise p
            yield p

    async def receive(self) -> dict:
        if self.messages:
            return self.messages.pop(0)
        await asyncio.Event().wait()


def disconnect() -> ClientDisconnect:
    return ClientDisconnect()


class Gen:
    """A Generation: yields `items` (each after a few loop turns), then raises `error` or waits forever (`hang`)."""

    def __init__(self, items: list, error: Exception | None = None, hang: bool = False):
        self.items, self.error, self.hang, self.aborts = items, error, hang, 0

    def __aiter__(self):
        return self._events()

    async def _events(self):
        for item in self.items:
            for _ in range(3):
                await asyncio.sleep(0)
            yield item
        if self.error is not None:
            raise self.error
        if self.hang:
            await asyncio.Event().wait()

    def abort(self) -> None:
        self.aborts += 1
