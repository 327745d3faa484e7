"""POST /v1/completions: a prompt string or token ids (or a list of either); SSE streams one event per engine step
per prompt and choice, each with the step's token_ids when return_token_ids is set. Choice i * n + j is prompt i's
j-th sequence (vLLM's numbering). echo prepends the prompt (its text, token ids, and with logprobs its prompt
logprobs, the first token's None); with max_tokens 0 the choice is the prompt alone (vLLM's scoring form)."""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..engine.engine import StepOutput
from .protocol import (
    CompletionRequest,
    chunk,
    completion_logprobs,
    new_id,
    now,
    prompt_logprobs_json,
    sum_usage,
    usage_json,
)
from .serving import APIError, EventStream, ServingContext, collect, sse


def register(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await ctx.parse(request, CompletionRequest)
        prompt_lp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_lp = max(prompt_lp or 0, req.logprobs)
        try:
            max_tokens = 1 if req.echo_only else req.max_tokens
            params = req.sampling_params(max_tokens, req.logprobs, prompt_lp, req.best_of, ctx.sampling_defaults)
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(":")[0]) from None
        await ctx.encode_prediction(params)
        cut = req.truncate_prompt_tokens
        prompts = [
            p if isinstance(p, list) else await ctx.encode(p, add_special_tokens=True, truncating=cut is not None)
            for p in req.prompts()
        ]
        prompts = [ctx.truncate(p, cut, req.max_tokens) for p in prompts]
        rid, created = new_id("cmpl"), now()
        gen = await ctx.submit(prompts, params, rid)
        if req.stream:
            return EventStream(_stream(ctx, req, prompts, gen, rid, created), gen)
        outs = await collect(request, gen)
        if outs is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        return _response(ctx, req, prompts, outs, rid, created)


def _top(ctx: ServingContext, req: CompletionRequest, tops: list[dict[int, float] | None]) -> list[dict | None]:
    as_ids = req.return_tokens_as_token_ids
    return [None if d is None else dict(zip(ctx.token_texts(list(d), as_ids), d.values())) for d in tops]


def _echo(ctx: ServingContext, req: CompletionRequest, prompt: list[int], o: StepOutput) -> dict:
    """The prompt's part of a choice with echo: text, token ids, logprobs (from o.prompt_logprobs)."""
    part = {"text": ctx.tok.decode(prompt, skip_special_tokens=False) if ctx.tok else "", "ids": prompt}
    if req.logprobs is not None:
        entries = o.prompt_logprobs or [None] * len(prompt)
        lps = [None if e is None else e[t] for t, e in zip(prompt, entries)]
        k = req.logprobs
        tops = [None if e is None else dict(list(e.items())[: k + 1]) for e in entries]
        part.update(lps=lps, tops=_top(ctx, req, tops))
    return part


def _choice(
    ctx: ServingContext,
    req: CompletionRequest,
    index: int,
    ids: list[int],
    text: str,
    o: StepOutput,
    lps: list[float],
    tops: list[dict[int, float]],
    offset: int,
    echo: dict | None,
) -> dict:
    """One choice (or one streamed event of it): its new ids, text and logprobs, after the echoed prompt if any."""
    c = {"index": index, "text": text, "finish_reason": o.finish_reason, "logprobs": None}
    if o.finish_reason == "stop" and o.stop_reason is not None:
        c["stop_reason"] = o.stop_reason
    if req.return_token_ids:
        c["token_ids"] = ids
    if req.logprobs is not None:
        tok_text, top = (
            ctx.token_texts(ids, req.return_tokens_as_token_ids),
            _top(ctx, req, [_with_sampled(t, lp, d) for t, lp, d in zip(ids, lps, tops)]),
        )
        if echo is not None:
            tok_text, lps, top = (
                ctx.token_texts(echo["ids"], req.return_tokens_as_token_ids) + tok_text,
                echo["lps"] + lps,
                echo["tops"] + top,
            )
        c["logprobs"] = completion_logprobs(tok_text, lps, offset, top)
    if req.prompt_logprobs is not None and o.prompt_logprobs is not None:
        c["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs, ctx.token_texts)
    if echo is not None:
        c["text"] = echo["text"] + text
        if req.return_token_ids:
            c["prompt_token_ids"] = echo["ids"]
    return c


def _prompt_only(o: StepOutput) -> StepOutput:
    """An event of an echo-only request (max_tokens 0): the engine's one token dropped, as if none was asked for."""
    usage = dataclasses.replace(o.usage, completion_tokens=0)
    return dataclasses.replace(
        o,
        new_token_ids=[],
        new_text="",
        new_logprobs=[],
        new_top_logprobs=[],
        finish_reason="length" if o.finished else None,
        stop_reason=None,
        usage=usage,
    )


def _with_sampled(t: int, lp: float, top: dict[int, float]) -> dict[int, float]:
    """The sampled token's entry, then the top alternatives (vLLM's top_logprobs holds both)."""
    return {t: lp, **{i: v for i, v in top.items() if i != t}}


async def _stream(ctx: ServingContext, req: CompletionRequest, prompts, gen, rid: str, created: int):
    name, n = ctx.model_name, req.n
    usages, offsets, echoed = {}, {}, set()
    async for i, o in gen:
        o = _prompt_only(o) if req.echo_only else o
        idx = i * n + o.index
        echo = None
        if req.echo and idx not in echoed:
            echoed.add(idx)
            echo = _echo(ctx, req, prompts[i], o)
        c = _choice(
            ctx,
            req,
            idx,
            o.new_token_ids,
            o.new_text,
            o,
            o.new_logprobs or [],
            o.new_top_logprobs or [{}] * len(o.new_token_ids),
            offsets.get(idx, 0),
            echo,
        )
        if c["logprobs"]:
            offsets[idx] = offsets.get(idx, 0) + sum(map(len, c["logprobs"]["tokens"]))
        usage = usage_json(o.usage) if req.continuous_usage else None
        if o.finished:
            usages[i] = o.usage
        yield sse(chunk("text_completion", rid, name, created, [c], usage))
    if req.include_usage:
        yield sse(chunk("text_completion", rid, name, created, [], usage_json(sum_usage(list(usages.values())))))
    yield "data: [DONE]\n\n"


def _response(
    ctx: ServingContext, req: CompletionRequest, prompts, outs: dict[int, list[StepOutput]], rid: str, created: int
) -> dict:
    if req.echo_only:
        outs = {i: [_prompt_only(o) for o in os] for i, os in outs.items()}
    choices, usages = [], []
    for i in range(len(outs)):
        for j in range(req.n):
            steps = [o for o in outs[i] if o.index == j]
            ids = [t for o in steps for t in o.new_token_ids]
            lps = [x for o in steps for x in o.new_logprobs or []]
            tops = [x for o in steps for x in o.new_top_logprobs or []] or [{}] * len(ids)
            echo = _echo(ctx, req, prompts[i], steps[0]) if req.echo else None
            text = "".join(o.new_text for o in steps)
            last = dataclasses.replace(steps[-1], prompt_logprobs=steps[0].prompt_logprobs)
            choices.append(_choice(ctx, req, i * req.n + j, ids, text, last, lps, tops, 0, echo))
        usages.append(outs[i][-1].usage)  # the last event holds the request's usage (all its choices)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage_json(sum_usage(usages)),
    }
