"""POST /v1/chat/completions: the model's chat template, then one engine request; SSE streams one
chat.completion.chunk per engine step (the first carries the assistant role)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..engine.engine import StepOutput
from .protocol import ChatCompletionRequest, chat_logprobs, chunk, new_id, now, usage_json
from .serving import APIError, EventStream, ServingContext, collect, sse


def register(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req: ChatCompletionRequest = await ctx.parse(request, ChatCompletionRequest)
        tok = ctx.tok
        if tok is None or not tok.has_chat_template:
            raise APIError(400, "messages: this model has no chat template; use /v1/completions", "messages")
        try:
            text = tok.apply_chat_template(
                [m.model_dump(exclude_none=True) for m in req.messages],
                add_generation_prompt=req.add_generation_prompt,
                **(req.chat_template_kwargs or {}),
            )
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise APIError(400, msg if msg.startswith("messages") else f"messages: {msg}", "messages") from None
        try:
            params = req.sampling_params(req.max_completion_tokens or req.max_tokens, 0 if req.logprobs else None)
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(":")[0]) from None
        ids = await ctx.encode(text, add_special_tokens=False, field="messages")
        rid, created = new_id("chatcmpl"), now()
        gen = await ctx.submit([ids], params, rid, field="messages")
        if req.stream:
            return EventStream(_stream(ctx, req, gen, rid, created), gen)
        outs = await collect(request, gen)
        if outs is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        return _response(ctx, req, outs[0], rid, created)


def _logprobs(ctx: ServingContext, req: ChatCompletionRequest, ids: list[int], lps: list[float] | None):
    return chat_logprobs(ctx.token_texts(ids), lps or []) if req.logprobs else None


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, gen, rid: str, created: int):
    name, first, usage = ctx.model_name, True, None
    async for _, o in gen:
        delta = {"role": "assistant", "content": o.new_text} if first else {"content": o.new_text}
        first = False
        c = {
            "index": 0,
            "delta": delta,
            "finish_reason": o.finish_reason,
            "logprobs": _logprobs(ctx, req, o.new_token_ids, o.new_logprobs),
        }
        if req.return_token_ids:
            c["token_ids"] = o.new_token_ids
        usage = o.usage
        yield sse(
            chunk(
                "chat.completion.chunk", rid, name, created, [c], usage_json(o.usage) if req.continuous_usage else None
            )
        )
    if req.include_usage and usage is not None:
        yield sse(chunk("chat.completion.chunk", rid, name, created, [], usage_json(usage)))
    yield "data: [DONE]\n\n"


def _response(ctx: ServingContext, req: ChatCompletionRequest, steps: list[StepOutput], rid: str, created: int) -> dict:
    last = steps[-1]
    ids = [t for o in steps for t in o.new_token_ids]
    c = {
        "index": 0,
        "message": {"role": "assistant", "content": "".join(o.new_text for o in steps)},
        "finish_reason": last.finish_reason,
        "logprobs": _logprobs(ctx, req, ids, [x for o in steps for x in o.new_logprobs or []]),
    }
    if last.finish_reason == "stop" and last.stop_reason is not None:
        c["stop_reason"] = last.stop_reason
    if req.return_token_ids:
        c["token_ids"] = ids
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": ctx.model_name,
        "choices": [c],
        "usage": usage_json(last.usage),
    }
