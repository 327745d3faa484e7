"""POST /v1/completions: a prompt string or token ids (or a list of either); SSE streams one event per engine step
per prompt, each with the step's token_ids when return_token_ids is set."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..engine.engine import StepOutput
from .protocol import CompletionRequest, chunk, completion_logprobs, new_id, now, sum_usage, usage_json
from .serving import APIError, EventStream, ServingContext, collect, sse


def register(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await ctx.parse(request, CompletionRequest)
        try:
            params = req.sampling_params(req.max_tokens, req.logprobs)
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(":")[0]) from None
        prompts = [p if isinstance(p, list) else await ctx.encode(p, add_special_tokens=True) for p in req.prompts()]
        rid, created = new_id("cmpl"), now()
        gen = await ctx.submit(prompts, params, rid)
        if req.stream:
            return EventStream(_stream(ctx, req, gen, rid, created), gen)
        outs = await collect(request, gen)
        if outs is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        return _response(ctx, req, outs, rid, created)


def _choice(ctx: ServingContext, req: CompletionRequest, index: int, o: StepOutput, offset: int) -> dict:
    c = {"index": index, "text": o.new_text, "finish_reason": o.finish_reason, "logprobs": None}
    if o.finish_reason == "stop" and o.stop_reason is not None:
        c["stop_reason"] = o.stop_reason
    if req.return_token_ids:
        c["token_ids"] = o.new_token_ids
    if req.logprobs is not None:
        c["logprobs"] = completion_logprobs(ctx.token_texts(o.new_token_ids), o.new_logprobs or [], offset)
    return c


async def _stream(ctx: ServingContext, req: CompletionRequest, gen, rid: str, created: int):
    name = ctx.model_name
    usages, offsets = {}, {}
    async for i, o in gen:
        c = _choice(ctx, req, i, o, offsets.get(i, 0))
        if c["logprobs"]:
            offsets[i] = offsets.get(i, 0) + sum(map(len, c["logprobs"]["tokens"]))
        usage = usage_json(o.usage) if req.continuous_usage else None
        if o.finished:
            usages[i] = o.usage
        yield sse(chunk("text_completion", rid, name, created, [c], usage))
    if req.include_usage:
        yield sse(chunk("text_completion", rid, name, created, [], usage_json(sum_usage(list(usages.values())))))
    yield "data: [DONE]\n\n"


def _response(
    ctx: ServingContext, req: CompletionRequest, outs: dict[int, list[StepOutput]], rid: str, created: int
) -> dict:
    choices = []
    for i in range(len(outs)):
        steps = outs[i]
        last = steps[-1]
        ids = [t for o in steps for t in o.new_token_ids]
        c = {
            "index": i,
            "text": "".join(o.new_text for o in steps),
            "finish_reason": last.finish_reason,
            "logprobs": None,
        }
        if last.finish_reason == "stop" and last.stop_reason is not None:
            c["stop_reason"] = last.stop_reason
        if req.return_token_ids:
            c["token_ids"] = ids
        if req.logprobs is not None:
            c["logprobs"] = completion_logprobs(
                ctx.token_texts(ids), [x for o in steps for x in o.new_logprobs or []], 0
            )
        choices.append(c)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage_json(sum_usage([outs[i][-1].usage for i in range(len(outs))])),
    }
