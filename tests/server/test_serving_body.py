"""server/serving.py's request body steps alone: the size limits, JSON parsing, lone surrogates, pydantic errors as
one message naming the field, and the model name, each refusal's status, message and field asserted exactly."""

import asyncio
import json
from typing import Literal

import pytest
from pydantic import BaseModel, ValidationError, field_validator, model_validator

from mlaserve.server import serving
from mlaserve.server.chat_tools import ChatOptions
from mlaserve.server.serving import APIError, ServingContext, _is_branch, bad_unicode, validation_error

from .serving_fakes import Engine, HTTPRequest, Tok, context, disconnect


class Msg(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict] | None = None


class Body(BaseModel):
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[Msg] = []
    stop: list[int] | list[str] | None = None
    n: int = 1

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v < 1:
            raise ValueError("must be at least 1")
        return v

    @model_validator(mode="after")
    def _one(self):
        if self.prompt is not None and self.messages:
            raise ValueError("give prompt or messages, not both")
        return self


def _refusal(coro) -> tuple[int, str, str | None]:
    with pytest.raises(APIError) as e:
        asyncio.run(coro)
    assert str(e.value) == e.value.message
    return e.value.status, e.value.message, e.value.param


def test_api_error_holds_status_message_and_field():
    e = APIError(413, "prompt: too long", "prompt")
    assert (e.status, e.message, e.param, str(e)) == (413, "prompt: too long", "prompt", "prompt: too long")
    assert APIError(503, "overloaded").param is None


BRANCH_TAGS = ["str", "int", "float", "bool", "dict", "list", "none", "list[int]", "function-after[f]"]


@pytest.mark.parametrize("tag", BRANCH_TAGS)
def test_union_branch_tags(tag):
    assert _is_branch(tag)


@pytest.mark.parametrize("x", ["prompt", "messages", "strict", 0, 3])
def test_fields_are_not_branch_tags(x):
    assert not _is_branch(x)


@pytest.mark.parametrize(
    "data,message,field",
    [
        ({"prompt": 12}, "prompt: Input should be a valid string; or Input should be a valid list", "prompt"),
        (
            {"prompt": [1, "a"]},
            "prompt: Input should be a valid string; or Input should be a valid integer, unable to parse string as an "
            "integer",
            "prompt",
        ),
        ({"messages": [{"role": "x"}]}, "messages[0].role: Input should be 'user' or 'assistant'", "messages[0].role"),
        (
            {"messages": [{"role": "user"}, {"role": "user", "content": 5}]},
            "messages[1].content: Input should be a valid string; or Input should be a valid list",
            "messages[1].content",
        ),
        ({"stop": 5}, "stop: Input should be a valid list", "stop"),  # two branches, one message
        ({"n": 0}, "n: must be at least 1", "n"),
        ({"prompt": "x", "messages": [{"role": "user"}]}, "body: give prompt or messages, not both", "body"),
        ({"prompt": 5, "n": "a"}, "prompt: Input should be a valid string; or Input should be a valid list", "prompt"),
    ],
)
def test_validation_error_is_one_message_naming_the_field(data, message, field):
    with pytest.raises(ValidationError) as e:
        Body.model_validate(data)
    err = validation_error(e.value)
    assert (err.status, err.message, err.param) == (400, message, field)


def test_bad_unicode_finds_the_first_lone_surrogate_and_its_field():
    assert bad_unicode("plain") is None and bad_unicode("é ü 字") is None
    assert bad_unicode("\ud800") == ("body", 0)
    assert bad_unicode("ab\udfff", "x") == ("x", 2)
    assert bad_unicode({"a": {"b": ["ok", "é\ud800"]}}) == ("a.b[1]", 1)
    assert bad_unicode({"p": [1, 2.5, "\ud800"]}) == ("p[2]", 0)  # numbers skipped, strings checked
    assert bad_unicode({"x": "\ud800", "y": "a\udfff"}) == ("x", 0)  # the first
    assert bad_unicode({"ok": "é", "k\ud800": 1}) == ("k\ud800", 1)  # a key
    assert bad_unicode({"m": [{"content": "a\ud800"}]}) == ("m[0].content", 1)
    assert bad_unicode({"a": [1, {"b": None}], "c": True}) is None


def test_read_body_under_and_at_the_limit():
    ctx = context(max_request_bytes=10)
    assert asyncio.run(ctx.read_body(HTTPRequest([b"12345", b"67890"], {"content-length": "10"}))) == b"1234567890"
    assert asyncio.run(ctx.read_body(HTTPRequest([b"ab", b"c"]))) == b"abc"  # no content-length header
    assert asyncio.run(ctx.read_body(HTTPRequest([b"abc"], {"content-length": "chunked"}))) == b"abc"


def test_read_body_refuses_a_declared_or_streamed_size_over_the_limit():
    ctx = context(max_request_bytes=10)
    big = HTTPRequest([b"x"], {"content-length": "11"})
    assert _refusal(ctx.read_body(big)) == (413, "body: the request body is 11 bytes; the limit is 10", "body")
    over = HTTPRequest([b"12345", b"678901"], {"content-length": "5"})  # the header lied
    assert _refusal(ctx.read_body(over)) == (413, "body: the request body exceeds the limit of 10 bytes", "body")
    gone = HTTPRequest([b"123", disconnect()])
    assert _refusal(ctx.read_body(gone)) == (499, "body: the client disconnected before sending it all", "body")


def _parse(body: bytes):
    return context(max_request_bytes=1 << 20).parse(HTTPRequest([body]), Body)


def test_parse_refuses_what_is_not_a_json_object():
    for raw in (b'{"prompt": "x",', b"\xff\xfe", b""):
        try:
            json.loads(raw)
        except ValueError as e:
            expected = f"body: malformed JSON: {e}"
        assert _refusal(_parse(raw)) == (400, expected, "body")
    assert _refusal(_parse(b'{"n": NaN}')) == (400, "body: malformed JSON: NaN is not valid JSON", "body")
    assert _refusal(_parse(b'{"n": -Infinity}')) == (400, "body: malformed JSON: -Infinity is not valid JSON", "body")
    status, message, field = _refusal(_parse(b"[" * 100000 + b"]" * 100000))
    assert (status, field) == (400, "body") and message.startswith("body: malformed JSON: maximum recursion depth")
    assert _refusal(_parse(b"[1, 2]")) == (400, "body: must be a JSON object, got list", "body")
    assert _refusal(_parse(b'"x"')) == (400, "body: must be a JSON object, got str", "body")


def test_parse_refuses_lone_surrogates_naming_the_field_and_too_deep_bodies(monkeypatch):
    raw = b'{"messages": [{"role": "user", "content": "ab\\ud800"}]}'
    msg = "messages[0].content: not valid unicode (a lone surrogate at character 2)"
    assert _refusal(_parse(raw)) == (400, msg, "messages[0].content")

    def too_deep(data):
        raise RecursionError

    monkeypatch.setattr(serving, "bad_unicode", too_deep)
    assert _refusal(_parse(b'{"prompt": "x"}')) == (400, "body: nested too deeply", "body")


def test_parse_validates_and_checks_the_model_name():
    assert _refusal(_parse(b'{"n": 0}')) == (400, "n: must be at least 1", "n")
    msg = "model: 'gpt-4' does not exist; this server serves 'tiny'"
    assert _refusal(_parse(b'{"model": "gpt-4", "prompt": "x"}')) == (404, msg, "model")
    req = asyncio.run(_parse(b'{"prompt": "x", "n": 2}'))
    assert isinstance(req, Body) and (req.model, req.prompt, req.n) == (None, "x", 2)
    assert asyncio.run(_parse(b'{"model": "tiny", "prompt": [1, 2]}')).prompt == [1, 2]


def test_context_takes_the_engine_limits_and_the_longest_token(tmp_path, caplog):
    eng = Engine(Tok())
    ctx = ServingContext(eng, "tiny", 123)
    assert (ctx.engine, ctx.model_name, ctx.max_request_bytes) == (eng, "tiny", 123)
    assert ctx.llm is eng.engine and ctx.tok is eng.engine.tokenizer and ctx.metrics is eng.metrics
    assert ctx.chat_options == ChatOptions() and ctx.sampling_defaults == {}
    assert ctx.max_token_chars == 6  # "<|im|>", an added token
    assert ServingContext(Engine(None), "tiny", 1).max_token_chars == 0
    # generation_config.json's sampling fields become the defaults, logged
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))
    with caplog.at_level("INFO", logger="mlaserve.server"):
        ctx = ServingContext(Engine(Tok(), model=str(tmp_path)), "tiny", 1, None)
    assert ctx.sampling_defaults == {"temperature": 0.6, "top_p": 0.95}
    assert caplog.messages == [
        "generation_config.json sets the sampling defaults {'temperature': 0.6, 'top_p': 0.95} "
        "(--generation-config vllm: ignore it)"
    ]
    opts = ChatOptions(generation_config="vllm")
    assert ServingContext(Engine(Tok(), model=str(tmp_path)), "tiny", 1, opts).sampling_defaults == {}


def test_a_speculative_server_applies_every_default(tmp_path):
    """generation_config.json's repetition_penalty applies under speculative decoding too (the verify runs the
    logits processors), so a speculative server takes the same defaults as a plain one."""
    gen = {"temperature": 0.7, "top_p": 0.95, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert ServingContext(Engine(Tok(), model=str(tmp_path)), "tiny", 1).sampling_defaults == gen
    assert ServingContext(Engine(Tok(), model=str(tmp_path), spec_k=1), "tiny", 1).sampling_defaults == gen
