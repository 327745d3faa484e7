"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) and `mlaserve serve`.

Every bad request gets an OpenAI-style JSON error naming the field; the engine keeps serving the rest.
Streaming sends one SSE event per engine step per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from ..engine.engine import StepOutput
from .async_engine import AsyncEngine, EngineDeadError
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, chunk, error_json, new_id, now, sum_usage, usage_json

log = logging.getLogger("mlaserve.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _validation_message(e: ValidationError) -> tuple[str, str]:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    return f"{loc}: {err['msg']}", loc


def build_app(engine: AsyncEngine, model_name: str, max_request_bytes: int = 16 << 20) -> FastAPI:
    app = FastAPI(title="mlaserve", version="0.1.0")
    llm = engine.engine
    tok = llm.tokenizer
    metrics = engine.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if metrics:
            metrics.errors.labels(model_name, str(e.status)).inc()
        return JSONResponse(error_json(e.message, e.status, e.param), status_code=e.status)

    async def parse(request: Request, schema: type[BaseModel]):
        body = await request.body()
        if len(body) > max_request_bytes:
            raise APIError(413, f"request body is {len(body)} bytes; the limit is {max_request_bytes}")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the JSON body must be an object")
        try:
            req = schema.model_validate(data)
        except ValidationError as e:
            msg, loc = _validation_message(e)
            raise APIError(400, msg, loc) from None
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"model: {req.model!r} does not exist; this server serves {model_name!r}", "model")
        return req

    def encode(prompt) -> list[int]:
        if isinstance(prompt, str):
            if tok is None:
                raise APIError(400, "prompt: this model has no tokenizer; send token ids", "prompt")
            return tok.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def check(ids: list[int], params) -> None:
        try:
            engine.validate(ids, params)
        except ValueError as e:
            msg = str(e)
            field = msg.split(":", 1)[0]
            status = 413 if field == "prompt" and "max_model_len" in msg else 400
            raise APIError(status, msg, field) from None
        except OverflowError as e:
            raise APIError(503, f"server overloaded: {e}") from None
        except EngineDeadError as e:
            raise APIError(500, str(e)) from None

    async def run(ids_list, params, rid):
        """Merge the event streams of one request's prompts: yields (index, StepOutput)."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, ids):
            try:
                async for o in engine.generate(ids, params, f"{rid}-{i}"):
                    await q.put((i, o))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await q.put((i, e))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(ids_list)]
        done = 0
        try:
            while done < len(tasks):
                i, o = await q.get()
                if isinstance(o, BaseException):
                    raise o
                done += o.finished
                yield i, o
        finally:
            for t in tasks:
                t.cancel()

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    # ---- endpoints ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse(error_json(f"engine stopped: {engine.error!r}", 500), status_code=500)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "mlaserve", "max_model_len": llm.max_model_len,
                                            "vocab_size": llm.model_config.vocab_size}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render() if metrics else b"", media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse(request, CompletionRequest)
        try:
            params = req.sampling_params(req.max_tokens, req.logprobs)
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(":")[0]) from None
        ids_list = [encode(p) for p in req.prompts()]
        for ids in ids_list:
            check(ids, params)
        rid, created = new_id("cmpl"), now()

        def choice(i: int, o: StepOutput) -> dict:
            c = {"index": i, "text": o.new_text, "finish_reason": o.finish_reason, "logprobs": None}
            if req.return_token_ids:
                c["token_ids"] = o.new_token_ids
            if o.new_logprobs is not None:
                c["logprobs"] = {"tokens": [tok.decode([t], skip_special_tokens=False) if tok else str(t)
                                            for t in o.new_token_ids],
                                 "token_logprobs": o.new_logprobs, "top_logprobs": None, "text_offset": None}
            return c

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def stream():
                usages = {}
                async for i, o in run(ids_list, params, rid):
                    if o.finished:
                        usages[i] = o.usage
                    yield sse(chunk("text_completion", rid, model_name, created, [choice(i, o)]))
                if include_usage:
                    yield sse(chunk("text_completion", rid, model_name, created, [],
                                    usage_json(sum_usage(list(usages.values())))))
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        texts = {i: [] for i in range(len(ids_list))}
        finals: dict[int, StepOutput] = {}
        token_ids = {i: [] for i in range(len(ids_list))}
        lps = {i: [] for i in range(len(ids_list))}
        async for i, o in _until_disconnect(request, run(ids_list, params, rid)):
            texts[i].append(o.new_text)
            token_ids[i] += o.new_token_ids
            lps[i] += o.new_logprobs or []
            if o.finished:
                finals[i] = o
        choices = []
        for i in range(len(ids_list)):
            c = {"index": i, "text": "".join(texts[i]), "finish_reason": finals[i].finish_reason, "logprobs": None}
            if req.return_token_ids:
                c["token_ids"] = token_ids[i]
            if req.logprobs is not None:
                c["logprobs"] = {"token_logprobs": lps[i], "tokens": None, "top_logprobs": None, "text_offset": None}
            choices.append(c)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage_json(sum_usage([f.usage for f in finals.values()]))}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        if tok is None or not tok.has_chat_template:
            raise APIError(400, "messages: this model has no chat template; use /v1/completions", "messages")
        try:
            text = tok.apply_chat_template([m.model_dump(exclude_none=True) for m in req.messages],
                                           add_generation_prompt=req.add_generation_prompt,
                                           **(req.chat_template_kwargs or {}))
            params = req.sampling_params(req.max_completion_tokens or req.max_tokens,
                                         (req.top_logprobs or 0) if req.logprobs else None)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        ids = tok.encode(text, add_special_tokens=False)
        check(ids, params)
        rid, created = new_id("chatcmpl"), now()

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def stream():
                first, usage = True, None
                async for _, o in run([ids], params, rid):
                    delta = {"content": o.new_text}
                    if first:
                        delta = {"role": "assistant", **delta}
                        first = False
                    c = {"index": 0, "delta": delta, "finish_reason": o.finish_reason, "logprobs": None}
                    if req.return_token_ids:
                        c["token_ids"] = o.new_token_ids
                    usage = o.usage if o.finished else usage
                    yield sse(chunk("chat.completion.chunk", rid, model_name, created, [c]))
                if include_usage and usage is not None:
                    yield sse(chunk("chat.completion.chunk", rid, model_name, created, [], usage_json(usage)))
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        parts, final = [], None
        async for _, o in _until_disconnect(request, run([ids], params, rid)):
            parts.append(o.new_text)
            final = o
        msg = {"role": "assistant", "content": "".join(parts)}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": msg, "finish_reason": final.finish_reason, "logprobs": None}],
                "usage": usage_json(final.usage)}

    return app


async def _until_disconnect(request: Request, events):
    """Iterate events, stopping (and so aborting the requests) if the client disconnects."""
    it = events.__aiter__()
    while True:
        nxt = asyncio.ensure_future(it.__anext__())
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=0.5)
            if done:
                break
            if await request.is_disconnected():
                nxt.cancel()
                await events.aclose()
                return
        try:
            yield nxt.result()
        except StopAsyncIteration:
            return


# ---- `mlaserve serve` ------------------------------------------------------------------------------------
def add_cli_args(p: argparse.ArgumentParser) -> None:
    from ..cli import add_engine_args

    p.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded tiny random model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the folder's name)")
    p.add_argument("--max-queue-len", type=int, default=1024, help="requests held at once; more get 503")
    p.add_argument("--max-request-bytes", type=int, default=16 << 20, help="larger bodies get 413")
    add_engine_args(p)


def cli_main(args) -> int:
    import os

    import uvicorn

    from ..cli import engine_kwargs_from_args, run_if_follower_node
    from ..llm import LLM

    rc = run_if_follower_node(args)
    if rc is not None:
        return rc
    llm = LLM(args.model, max_queue_len=args.max_queue_len, **engine_kwargs_from_args(args))
    name = args.served_model_name or os.path.basename(os.path.normpath(llm.engine_config.model))
    metrics = Metrics(name)
    server: uvicorn.Server | None = None

    def fatal(e: BaseException) -> None:
        log.error("shutting down: %r", e)
        if server is not None:
            server.should_exit = True

    engine = AsyncEngine(llm.engine, metrics, on_fatal=fatal)
    app = build_app(engine, name, args.max_request_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    try:
        server.run()
    finally:
        engine.shutdown()
        llm.close()
    return 1 if engine.error else 0
