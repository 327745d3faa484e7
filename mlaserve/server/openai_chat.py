"""POST /v1/chat/completions: the model's chat template (with the request's tools), then one engine request (n
choices); SSE streams one chat.completion.chunk per engine step and choice (each choice's first carries the assistant
role). With a reasoning or tool-call parser, each choice's text goes through them (chat_output.py)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..engine.engine import StepOutput
from .chat_tools import ChatPlan, check_tool_choice, check_tools, plan_chat
from .protocol import ChatCompletionRequest, chat_logprobs, chunk, new_id, now, prompt_logprobs_json, usage_json
from .serving import APIError, EventStream, ServingContext, collect, sse


def register(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req: ChatCompletionRequest = await ctx.parse(request, ChatCompletionRequest)
        try:
            req.tools = check_tools(req.tools)
            req.tool_choice = check_tool_choice(req.tool_choice, req.tools)
            plan = plan_chat(req, ctx.chat_options, ctx.tok)
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(":")[0].split("[")[0]) from None
        text = ctx.render_chat(req, plan.template_tools)
        try:
            lp = (req.top_logprobs or 0) if req.logprobs else None
            if lp and lp > ctx.llm.cfg.max_logprobs:
                raise ValueError(f"top_logprobs: {lp} exceeds the server's max_logprobs {ctx.llm.cfg.max_logprobs}")
            params = req.sampling_params(
                req.max_completion_tokens or req.max_tokens, lp, req.prompt_logprobs, defaults=ctx.sampling_defaults
            )
            if plan.structured is not None:
                if params.structured is not None:
                    raise ValueError(
                        f"tool_choice: {req.tool_choice!r} forces a tool call through structured output; "
                        f"it cannot be combined with {params.structured.field}"
                    )
                params.structured = plan.structured
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(":")[0]) from None
        params.keep_special_token_ids = plan.keep_ids  # the parsers' markers survive skip_special_tokens
        await ctx.encode_prediction(params)
        cut = req.truncate_prompt_tokens
        ids = await ctx.encode(text, add_special_tokens=False, field="messages", truncating=cut is not None)
        ids = ctx.truncate(ids, cut, params.max_tokens)
        rid, created = new_id("chatcmpl"), now()
        gen = await ctx.submit([ids], params, rid, field="messages")
        if req.stream:
            return EventStream(_stream(ctx, req, plan, gen, rid, created), gen)
        outs = await collect(request, gen)
        if outs is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        return _response(ctx, req, plan, outs[0], rid, created)


def _logprobs(
    ctx: ServingContext, req: ChatCompletionRequest, ids: list[int], lps: list[float] | None, tops: list | None
):
    if not req.logprobs:
        return None
    top = (
        [list(zip(ctx.token_texts(list(d), req.return_tokens_as_token_ids), d.values())) for d in tops or []]
        if req.top_logprobs
        else None
    )
    return chat_logprobs(ctx.token_texts(ids, req.return_tokens_as_token_ids), lps or [], top)


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, plan: ChatPlan, gen, rid: str, created: int):
    name, parsers, usage = ctx.model_name, {}, None
    async for _, o in gen:
        first = o.index not in parsers
        if first:
            parsers[o.index] = plan.output()
        usage = o.usage
        p = parsers[o.index]
        delta = {"content": o.new_text} if p is None else p.delta(o.new_text, o.finished)
        finish = o.finish_reason if p is None else p.finish_reason(o.finish_reason)
        if first:
            delta = {"role": "assistant", "content": "", **delta}
        elif not delta and finish is None and not req.logprobs and not req.return_token_ids:
            continue  # the parsers hold this step's text back (a marker may be arriving)
        c = {
            "index": o.index,
            "delta": delta,
            "finish_reason": finish,
            "logprobs": _logprobs(ctx, req, o.new_token_ids, o.new_logprobs, o.new_top_logprobs),
        }
        if req.return_token_ids:
            c["token_ids"] = o.new_token_ids
        yield sse(
            chunk(
                "chat.completion.chunk", rid, name, created, [c], usage_json(o.usage) if req.continuous_usage else None
            )
        )
    if req.include_usage and usage is not None:
        yield sse(chunk("chat.completion.chunk", rid, name, created, [], usage_json(usage)))
    yield "data: [DONE]\n\n"


def _response(
    ctx: ServingContext, req: ChatCompletionRequest, plan: ChatPlan, events: list[StepOutput], rid: str, created: int
) -> dict:
    choices = []
    for j in range(req.n):
        steps = [o for o in events if o.index == j]
        last = steps[-1]
        ids = [t for o in steps for t in o.new_token_ids]
        lps = [x for o in steps for x in o.new_logprobs or []]
        tops = [x for o in steps for x in o.new_top_logprobs or []]
        text = "".join(o.new_text for o in steps)
        message, finish = {"role": "assistant", "content": text}, last.finish_reason
        p = plan.output()
        if p is not None:
            p.text = text
            message = p.message()
            finish = p.finish_reason(finish)
        c = {
            "index": j,
            "message": message,
            "finish_reason": finish,
            "logprobs": _logprobs(ctx, req, ids, lps, tops),
        }
        if last.finish_reason == "stop" and last.stop_reason is not None:
            c["stop_reason"] = last.stop_reason
        if req.return_token_ids:
            c["token_ids"] = ids
        choices.append(c)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage_json(events[-1].usage),  # the last event holds the request's usage (all its choices)
        "prompt_logprobs": prompt_logprobs_json(events[0].prompt_logprobs, ctx.token_texts),
    }
