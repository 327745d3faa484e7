"""What every OpenAI endpoint shares: body parsing and validation into APIErrors that name the field, prompt
encoding, submission to the AsyncEngine, SSE responses that abort on disconnect, and disconnect-aware collection."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from ..engine.engine import StepOutput
from ..types import SamplingParams
from .async_engine import AsyncEngine, EngineDeadError, Generation
from .chat_tools import ChatOptions, sampling_defaults
from .internal_errors import internal_error_message, log_internal_error, new_error_id
from .protocol import error_json

log = logging.getLogger("mlaserve.server")

THREAD_ENCODE_CHARS = 1 << 14  # longer prompt strings are tokenized off the event loop


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _is_branch(x) -> bool:
    """A union branch's tag in a pydantic error location (str, list[int], function-after[...]), not a field."""
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "dict", "list", "none"))


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as 'field: what is wrong' (the field as messages[0].role); a union's branches,
    which fail together, become one message."""
    errs = e.errors()

    def loc_of(err) -> tuple:
        loc = err["loc"]
        return tuple(loc[: next((i for i, x in enumerate(loc) if _is_branch(x)), len(loc))])

    loc = loc_of(errs[0])
    msgs = list(dict.fromkeys(x["msg"].removeprefix("Value error, ") for x in errs if loc_of(x) == loc))
    field = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or "body"
    return APIError(400, f"{field}: {'; or '.join(msgs)}", field)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def bad_unicode(data, path: str = "") -> tuple[str, int] | None:
    """The first string (or key) in a parsed JSON body that is not valid unicode: JSON's \\ud800 escapes decode
    to lone surrogates, which no tokenizer or UTF-8 response can hold -> (its field, e.g. messages[0].content, and
    the character's index); None when every string is valid."""
    if isinstance(data, str):
        if data.isascii():
            return None
        try:
            data.encode("utf-8")
        except UnicodeEncodeError as e:
            return path or "body", e.start
        return None
    if isinstance(data, dict):
        for k, v in data.items():
            sub = f"{path}.{k}" if path else str(k)
            bad = bad_unicode(k, sub) or bad_unicode(v, sub)
            if bad:
                return bad
    elif isinstance(data, list):
        for i, v in enumerate(data):
            if not isinstance(v, (int, float)):  # token ids: nothing to check
                bad = bad_unicode(v, f"{path}[{i}]")
                if bad:
                    return bad
    return None


class ServingContext:
    """One server's engine, tokenizer and limits, with the steps every endpoint takes."""

    def __init__(
        self, engine: AsyncEngine, model_name: str, max_request_bytes: int, chat_options: ChatOptions | None = None
    ):
        self.engine, self.model_name, self.max_request_bytes = engine, model_name, max_request_bytes
        self.llm = engine.engine
        self.tok = self.llm.tokenizer
        self.chat_options = chat_options or ChatOptions()
        # generation_config.json's sampling fields: the defaults of requests that leave them unset
        self.sampling_defaults = sampling_defaults(self.llm.cfg.model or "", self.chat_options)
        if self.sampling_defaults:
            log.info(
                "generation_config.json sets the sampling defaults %s (--generation-config vllm: ignore it)",
                self.sampling_defaults,
            )
        self.metrics = engine.metrics
        # The longest token text: a prompt string longer than max_model_len of them cannot fit (refused untokenized)
        self.max_token_chars = 0
        if self.tok is not None:
            self.max_token_chars = max(map(len, self.tok.backend.get_vocab(with_added_tokens=True)), default=0)

    # ---- the request body ----------------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        limit = self.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"body: the request body is {int(declared)} bytes; the limit is {limit}", "body")
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise APIError(413, f"body: the request body exceeds the limit of {limit} bytes", "body")
                parts.append(part)
        except ClientDisconnect:
            raise APIError(499, "body: the client disconnected before sending it all", "body") from None
        return b"".join(parts)

    async def parse(self, request: Request, schema: type[BaseModel]):
        body = await self.read_body(request)
        try:
            data = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise APIError(400, f"body: malformed JSON: {e}", "body") from None
        if not isinstance(data, dict):
            raise APIError(400, f"body: must be a JSON object, got {type(data).__name__}", "body")
        try:
            bad = bad_unicode(data)
        except RecursionError:
            raise APIError(400, "body: nested too deeply", "body") from None
        if bad is not None:
            field, i = bad
            raise APIError(400, f"{field}: not valid unicode (a lone surrogate at character {i})", field)
        try:
            req = schema.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model: {req.model!r} does not exist; this server serves {self.model_name!r}", "model")
        return req

    # ---- prompts -------------------------------------------------------------------------------------
    def render_chat(self, req, tools: list[dict] | None = None) -> str:
        """A request's `messages` (and `tools`) through the model's chat template (req: the chat or tokenize request)
        -> the prompt text; a 400 naming `messages` when there is no template or the template rejects them."""
        tok = self.tok
        if tok is None or not tok.has_chat_template:
            raise APIError(400, "messages: this model has no chat template; use /v1/completions", "messages")
        try:
            kwargs = {**(req.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
            gen = req.add_generation_prompt
            if getattr(req, "continue_final_message", False):
                kwargs["continue_final_message"] = True
                # add_generation_prompt left unset: off (vLLM asks for both; the two together are refused)
                gen = gen and "add_generation_prompt" in req.model_fields_set
            return tok.apply_chat_template(
                [m.model_dump() for m in req.messages],  # a null content stays (templates test `content is none`)
                add_generation_prompt=gen,
                **kwargs,
            )
        except (ValueError, TypeError) as e:
            msg = str(e)
            if msg.startswith("continue_final_message"):
                raise APIError(400, msg, "continue_final_message") from None
            raise APIError(400, msg if msg.startswith("messages") else f"messages: {msg}", "messages") from None

    async def encode(
        self, text: str, add_special_tokens: bool, field: str = "prompt", truncating: bool = False
    ) -> list[int]:
        """text -> token ids; a text too long for max_model_len is refused untokenized, unless the request
        truncates it (truncate_prompt_tokens: the body's size limit bounds it then)."""
        if self.tok is None:
            raise APIError(400, f"{field}: this model has no tokenizer; send token ids", field)
        limit = self.llm.max_model_len * self.max_token_chars
        if len(text) > limit and not truncating:
            raise APIError(
                413,
                f"{field}: {len(text)} characters cannot fit in max_model_len "
                f"{self.llm.max_model_len} tokens (at most {limit} characters)",
                field,
            )
        if len(text) > THREAD_ENCODE_CHARS:
            return await asyncio.to_thread(self.tok.encode, text, add_special_tokens)
        return self.tok.encode(text, add_special_tokens)

    async def encode_prediction(self, params) -> None:
        """params.prediction's text -> its token ids here (a thread for long texts), not in the engine's loop, for an
        NGRAM engine, which drafts from it (truncated, as the engine keeps no more than max_model_len of it); other
        engines ignore it, so it is dropped untokenized."""
        text, spec = params.prediction, self.llm.spec
        if isinstance(text, str):
            ngram = spec is not None and spec.is_ngram
            params.prediction = await self.encode(text, False, "prediction", truncating=True) if ngram else None

    def truncate(self, ids: list[int], keep: int | None, max_tokens: int | None) -> list[int]:
        """truncate_prompt_tokens, here so that usage, echo and the length checks see the prompt the engine runs
        (LLMEngine.truncated; its own cut of these ids then keeps them whole)."""
        try:
            return self.llm.truncated(ids, keep, max_tokens)
        except ValueError as e:
            raise APIError(400, str(e), "truncate_prompt_tokens") from None

    def check_length(self, ids: list[int], field: str = "prompt") -> None:
        n, llm = len(ids), self.llm
        if n >= llm.max_model_len:
            raise APIError(
                413, f"{field}: {n} tokens leave no room to generate within max_model_len {llm.max_model_len}", field
            )
        if llm.pool.pages_for(n + 1) > llm.pool.num_pages:
            raise APIError(
                413,
                f"{field}: {n} tokens need more KV pages than the cache holds "
                f"({llm.pool.num_pages} of {llm.pool.page_size} tokens)",
                field,
            )

    async def submit(
        self, prompts: list[list[int]], params: SamplingParams, request_id: str, field: str = "prompt"
    ) -> Generation:
        """Validate every prompt, then queue them all; the engine's refusals become APIErrors."""
        if len(prompts) > self.llm.cfg.max_queue_len:
            raise APIError(
                400,
                f"{field}: {len(prompts)} prompts in one request exceed max_queue_len {self.llm.cfg.max_queue_len}",
                field,
            )
        try:
            if params.structured is not None:  # compiled off the event loop; validate() then finds it cached
                await asyncio.to_thread(self.llm.grammars.compile, params.structured)
            for ids in prompts:
                self.check_length(ids, field)
                self.engine.validate(ids, params)
            return await self.engine.generate(prompts, params, request_id)
        except ValueError as e:
            field = str(e).split(":", 1)[0]
            raise APIError(400, str(e), field if field.isidentifier() else None) from None
        except OverflowError as e:
            raise APIError(503, f"server overloaded: {e}; retry later") from None
        except EngineDeadError as e:  # the engine stopped (a dead rank, a failed step): this server cannot serve
            raise APIError(503, str(e)) from None

    def token_texts(self, ids: list[int], as_ids: bool = False) -> list[str]:
        """Each token's text; as_ids (vLLM's return_tokens_as_token_ids): "token_id:N", which never collide."""
        if as_ids:
            return [f"token_id:{t}" for t in ids]
        if self.tok is None:
            return [str(t) for t in ids]
        return [self.tok.decode([t], skip_special_tokens=False) for t in ids]


# ---- responses ---------------------------------------------------------------------------------------
def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _guarded(events):
    """An SSE body: a failure mid-stream (the engine's, or a bug) ends it with an error event holding an error id
    (the log holds the details under it), then [DONE]."""
    try:
        async for e in events:
            yield e
    except Exception as e:  # noqa: BLE001 - the stream has started: an event is all the client can still get
        eid = new_error_id()
        log_internal_error(eid, "a streamed response failed", e)
        yield sse(error_json(internal_error_message(eid, e), 500))
        yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends: finished, client gone, or failed."""

    def __init__(self, events, gen: Generation):
        super().__init__(
            _guarded(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.abort()  # a no-op when every request finished


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, gen: Generation) -> dict[int, list[StepOutput]] | None:
    """Every event of a generation by prompt index; None (and the requests aborted) if the client leaves first."""

    async def consume():
        out: dict[int, list[StepOutput]] = {}
        async for i, o in gen:
            out.setdefault(i, []).append(o)
        return out

    task, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()  # an engine failure is an internal error (internal_errors.py)
        return None
    finally:
        task.cancel()
        watch.cancel()
        gen.abort()
