"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) and `mlaserve serve`.

Every bad request gets an OpenAI-style JSON error naming the field; the engine keeps serving the rest.
Streaming sends one SSE event per engine step per request. If the engine thread dies, or a tensor-parallel rank
does, every request in flight ends with an error, new ones get 503, /health fails and the server exits (status 1)
with the error, never hangs.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import LLMEngine
from ..version import __version__
from . import guard, openai_chat, openai_completions, tokenize
from .async_engine import AsyncEngine, EngineDeadError
from .chat_tools import ChatOptions
from .guard import HTTPLimits
from .http_limits import uvicorn_kwargs
from .internal_errors import InternalErrors, internal_error_message
from .metrics import Metrics
from .protocol import error_json, now
from .serving import APIError, ServingContext

log = logging.getLogger("mlaserve.server")
RANK_FAILURE_EXIT_S = 20.0  # after a rank died, `mlaserve serve` exits within this even if the server cannot stop


def model_card(llm: LLMEngine, model_name: str) -> dict:
    """The /v1/models entry, with what `bench serve` reads: vocab_size and the special token ids to avoid."""
    tok = llm.tokenizer
    eos = sorted(llm.eos_token_ids)
    special = set(eos)
    bos = tok.bos_token_id if tok is not None else llm.model_config.bos_token_id
    if bos is not None:
        special.add(bos)
    if tok is not None:
        special |= {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    return {
        "id": model_name,
        "object": "model",
        "created": now(),
        "owned_by": "mlaserve",
        "root": model_name,  # never the folder: no filesystem path in any response
        "max_model_len": llm.max_model_len,
        "vocab_size": llm.model_config.vocab_size,
        "bos_token_id": bos,
        "eos_token_id": eos[0] if eos else None,
        "eos_token_ids": eos,
        "special_token_ids": sorted(special),
        **({"speculative": speculative_card(llm.spec)} if llm.spec is not None else {}),
    }


def speculative_card(spec) -> dict:
    """What `bench serve` records of the server's speculative decoding (REPLAY and simulated acceptance are marked
    benchmark-only)."""
    out = {
        "algorithm": spec.algorithm.upper(),
        "num_steps": spec.num_steps,
        "num_draft_tokens": spec.num_draft_tokens,
        "draft_model": spec.draft_model,
        "benchmark_only": spec.is_replay or spec.simulate_acceptance is not None,
    }
    if spec.is_ngram:
        out.update(prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
    if spec.is_replay:
        out.update(replay_miss_rate=spec.replay_miss_rate, replay_seed=spec.replay_seed)
    if spec.simulate_acceptance is not None:
        out.update(simulate_acceptance=spec.simulate_acceptance, replay_seed=spec.replay_seed)
    return out


def build_app(
    engine: AsyncEngine,
    model_name: str,
    max_request_bytes: int = 16 << 20,
    chat_options: ChatOptions | None = None,
    limits: HTTPLimits = HTTPLimits(),
) -> FastAPI:
    app = FastAPI(title="mlaserve", version=__version__, docs_url=None, redoc_url=None)
    guard.install(app, limits)
    ctx = ServingContext(engine, model_name, max_request_bytes, chat_options)
    metrics = engine.metrics
    card = model_card(engine.engine, model_name)  # static: made once, stamped with the server's start

    def error(status: int, message: str, param: str | None = None) -> JSONResponse:
        if metrics:
            metrics.errors.labels(model_name, str(status)).inc()
        return JSONResponse(error_json(message, status, param), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error(e.status, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)  # unknown routes (404), wrong methods (405)
    async def _http_error(request: Request, e: StarletteHTTPException):
        what = {
            404: f"no route {request.url.path}",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }.get(e.status_code, str(e.detail))
        return error(e.status_code, f"path: {what}", "path")

    app.add_middleware(InternalErrors, respond=lambda eid, e: error(500, internal_error_message(eid, e)))

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse(error_json(f"engine: {engine.stopped_message()}", 503), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != model_name:
            raise APIError(404, f"model: {model!r} does not exist; this server serves {model_name!r}", "model")
        return card

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render() if metrics else b"", media_type="text/plain; version=0.0.4")

    async def reset_prefix_cache():
        """vLLM's POST /reset_prefix_cache and SGLang's /flush_cache: the next prompts are computed whole (a
        benchmark's runs each start cold). Refused (409) while requests are running or waiting."""
        try:
            freed = await engine.reset_prefix_cache()
        except EngineDeadError:
            raise APIError(503, engine.stopped_message()) from None
        if freed is None:
            raise APIError(409, "prefix cache: not reset while requests are running or waiting; retry when idle")
        log.info("prefix cache reset: %d cached pages freed", freed)
        return {"status": "ok", "freed_pages": freed}

    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    app.add_api_route("/flush_cache", reset_prefix_cache, methods=["GET", "POST"])
    openai_completions.register(app, ctx)
    openai_chat.register(app, ctx)
    tokenize.register(app, ctx)
    return app


class Server:
    """An engine behind the HTTP app on uvicorn: what `mlaserve serve` runs, and what tests start in a thread."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 8000,
        max_request_bytes: int = 16 << 20,
        log_level: str = "info",
        chat_options: ChatOptions | None = None,
        limits: HTTPLimits = HTTPLimits(),
        root_path: str = "",
    ):
        self.model_name = model_name
        self.metrics = Metrics(model_name, spec_positions=engine.spec_k)
        self.async_engine = AsyncEngine(engine, self.metrics, on_fatal=self._fatal)
        self.rank_failure: BaseException | None = None  # a tensor-parallel rank died (watch_ranks)
        self._exit_after_s: float | None = None
        self.app = build_app(self.async_engine, model_name, max_request_bytes, chat_options, limits)
        # A bounded graceful shutdown: a dead engine must bring the server down even with clients attached.
        self.uvicorn = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=host,
                port=port,
                log_level=log_level,
                root_path=root_path,  # behind a proxy that serves the app under a path prefix
                timeout_graceful_shutdown=5,
                **uvicorn_kwargs(limits),
            )
        )

    def _fatal(self, e: BaseException) -> None:
        log.error("the engine thread failed (%r): shutting the server down", e)
        self.uvicorn.should_exit = True

    def watch_ranks(self, llm, exit_after_s: float | None = None) -> None:
        """Serve an LLM's tensor-parallel ranks: a rank that dies fails the requests and stops the server
        (rank_failed), and a step that failed on a collective with it reports the rank. exit_after_s: the process
        exits that long after the failure even if the server has not stopped (`mlaserve serve`)."""
        self.async_engine.root_cause = llm.root_cause
        self._exit_after_s = exit_after_s
        llm.set_rank_failure_handler(self.rank_failed)

    def rank_failed(self, e: BaseException) -> None:
        """A tensor-parallel rank died (the watchdog thread's report): fail every request now (the engine thread may
        be stuck in a collective with the dead rank), refuse new ones with 503, and stop."""
        log.error("%s: failing every request and shutting the server down", e)
        self.rank_failure = e
        self.async_engine.fail(e)
        self.uvicorn.should_exit = True
        if self._exit_after_s is not None:
            threading.Thread(target=_exit_after, args=(self._exit_after_s, e), daemon=True).start()

    def run(self, sockets: list[socket.socket] | None = None) -> int:
        """Serve until stopped; 0 after a clean stop, 1 when the engine failed."""
        try:
            self.uvicorn.run(sockets=sockets)
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: a clean stop
            pass
        finally:
            self.async_engine.shutdown()
        if self.async_engine.error is not None:
            print(
                f"mlaserve serve: the engine failed: {self.async_engine.error!r}; the server stopped", file=sys.stderr
            )
            return 1
        return 0

    def stop(self) -> None:
        self.uvicorn.should_exit = True


# ---- `mlaserve serve` ------------------------------------------------------------------------------------
def add_cli_args(p: argparse.ArgumentParser) -> None:
    from ..args import add_engine_args

    p.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded Python code model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the folder's name)")
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=1024,
        help="requests the engine holds (waiting + running); more get 503 (default: %(default)s)",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=16 << 20, help="larger request bodies get 413 (default: %(default)s)"
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="parse the model's tool calls into `tool_calls`: kimi_k2, deepseek_v3, deepseek_v31",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto", the default with tools); needs '
        "--tool-call-parser",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="return the model's thinking as `reasoning_content`: deepseek_r1, deepseek_v3, kimi_k2",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="auto: the model's generation_config.json sets the sampling defaults (temperature, top_p, top_k, min_p, "
        "repetition_penalty) of requests that leave them unset; vllm: ignore it (default: %(default)s)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level; unset: --log-level's",
    )
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under (FastAPI root_path)")
    guard.add_http_args(p)
    add_engine_args(p)


def chat_options_from_args(args) -> ChatOptions:
    """Raises ValueError naming the flag."""
    return ChatOptions(
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        generation_config=args.generation_config,
    )


def cli_main(args) -> int:
    from ..args import engine_kwargs_from_args, run_if_follower_node
    from ..llm import LLM

    if args.max_queue_len < 1 or args.max_request_bytes < 1:
        print("mlaserve serve: --max-queue-len and --max-request-bytes must be >= 1", file=sys.stderr)
        return 2
    limits = guard.http_limits_from_args(args)
    if args.metrics_require_key and not limits.api_keys:
        raise ValueError(f"--metrics-require-key: give --api-key (or ${guard.API_KEY_ENV}) too")
    rc = run_if_follower_node(args)
    if rc is not None:
        return rc
    chat_options = chat_options_from_args(args)
    check_port_free(args.host, args.port)  # before minutes of loading, not after
    llm = LLM(args.model, max_queue_len=args.max_queue_len, **engine_kwargs_from_args(args))
    name = args.served_model_name or os.path.basename(os.path.normpath(llm.engine_config.model))
    server = Server(
        llm.engine,
        name,
        args.host,
        args.port,
        args.max_request_bytes,
        log_level=args.uvicorn_log_level or args.log_level.lower(),
        chat_options=chat_options,
        limits=limits,
        root_path=args.root_path,
    )
    server.watch_ranks(llm, exit_after_s=RANK_FAILURE_EXIT_S)
    if limits.api_keys:
        log.info(
            "API keys: %d; open without one: /health, /version%s",
            len(limits.api_keys),
            "" if limits.metrics_require_key else ", /metrics",
        )
    try:
        rc = server.run()
    finally:
        if server.rank_failure is not None:  # the other ranks were ended; leaving the group could wait on them
            print(f"mlaserve serve: {server.rank_failure}; the server stopped", file=sys.stderr, flush=True)
            os._exit(1)
        if server.async_engine.error is not None and llm.parallel.world_size > 1:
            # a step failed midway: the other ranks may sit in one of its collectives, which a clean stop would wait
            # on; they exit with this process (launch.py: _exit_with_parent)
            sys.stderr.flush()
            os._exit(1)
        llm.close()
    return rc


def check_port_free(host: str, port: int) -> None:
    """Raise OSError naming --host / --port when the server could not bind them."""
    if not 0 <= port <= 65535:
        raise OSError(f"--port: must be in 0-65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def _exit_after(seconds: float, e: BaseException) -> None:
    """A server that has not stopped `seconds` after a rank died (uvicorn stuck) exits anyway, with the message."""
    from ..distributed.launch import abort

    time.sleep(seconds)
    abort(e)
