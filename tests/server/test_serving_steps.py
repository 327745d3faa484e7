"""server/serving.py's prompt and response steps alone: the chat template call, encoding (off the event loop when
long), the length checks, submission and the engine's refusals as APIErrors, token texts, SSE framing, a stream's
error event, the aborts when a stream or a collection ends, each asserted exactly."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from mlaserve.server import serving
from mlaserve.server.async_engine import EngineDeadError
from mlaserve.server.protocol import ChatMessage
from mlaserve.server.serving import THREAD_ENCODE_CHARS, APIError, EventStream, collect, sse

from .serving_fakes import Gen, HTTPRequest, Tok, context


def _refusal(fn, *args) -> tuple[int, str, str | None]:
    with pytest.raises(APIError) as e:
        out = fn(*args)
        if asyncio.iscoroutine(out):
            asyncio.run(out)
    return e.value.status, e.value.message, e.value.param


def _chat(messages, kwargs=None, add_generation_prompt=True, gen_set=None, **fields):
    """A chat request's fields as render_chat reads them; gen_set: add_generation_prompt was sent (default: when
    False)."""
    msgs = [ChatMessage(**m) for m in messages]
    gen_set = not add_generation_prompt if gen_set is None else gen_set
    set_ = set(fields) | ({"add_generation_prompt"} if gen_set else set())
    return SimpleNamespace(
        messages=msgs,
        chat_template_kwargs=kwargs,
        add_generation_prompt=add_generation_prompt,
        model_fields_set=set_,
        **fields,
    )


def test_render_chat_passes_the_messages_kwargs_and_tools():
    tok = Tok()
    ctx = context(tok)
    tools = [{"type": "function", "function": {"name": "f"}}]
    req = _chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], {"thinking": False})
    assert ctx.render_chat(req, tools) == "PROMPT"
    assert ctx.render_chat(_chat([{"role": "user", "content": "x"}], None, False)) == "PROMPT"
    assert ctx.render_chat(_chat([{"role": "user", "content": "y"}]), []) == "PROMPT"
    assert tok.template_calls == [
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
            True,
            {"thinking": False, "tools": tools},
        ),
        ([{"role": "user", "content": "x"}], False, {}),
        ([{"role": "user", "content": "y"}], True, {}),
    ]
    # continue_final_message: the generation prompt off unless the request set it (then the template refuses both)
    ctx.render_chat(_chat([{"role": "user", "content": "z"}], continue_final_message=True))
    ctx.render_chat(_chat([{"role": "user", "content": "w"}], None, True, gen_set=True, continue_final_message=True))
    assert tok.template_calls[3:] == [
        ([{"role": "user", "content": "z"}], False, {"continue_final_message": True}),
        ([{"role": "user", "content": "w"}], True, {"continue_final_message": True}),
    ]


def test_render_chat_refusals_name_messages():
    req = _chat([{"role": "user", "content": "hi"}])
    no_template = (400, "messages: this model has no chat template; use /v1/completions", "messages")
    assert _refusal(context(None).render_chat, req) == no_template
    tok = Tok()
    tok.has_chat_template = False
    assert _refusal(context(tok).render_chat, req) == no_template
    tok = Tok()
    ctx = context(tok)
    tok.template_error = ValueError("roles must alternate")
    assert _refusal(ctx.render_chat, req) == (400, "messages: roles must alternate", "messages")
    tok.template_error = TypeError("messages[1]: content must be a string")
    assert _refusal(ctx.render_chat, req) == (400, "messages[1]: content must be a string", "messages")


def test_encode_limits_the_characters_and_leaves_the_loop_for_long_text():
    tok = Tok()
    ctx = context(tok)  # max_model_len 20, the longest token 6 characters: at most 120
    assert asyncio.run(ctx.encode("x" * 120, True)) == [120, 1]
    assert asyncio.run(ctx.encode("abc", False, "messages")) == [3, 0]
    msg = "prompt: 121 characters cannot fit in max_model_len 20 tokens (at most 120 characters)"
    assert _refusal(ctx.encode, "x" * 121, True) == (413, msg, "prompt")
    msg = "input: 121 characters cannot fit in max_model_len 20 tokens (at most 120 characters)"
    assert _refusal(ctx.encode, "x" * 121, True, "input") == (413, msg, "input")
    assert tok.encode_threads == [True, True]
    ctx.llm.max_model_len = 10_000
    assert asyncio.run(ctx.encode("y" * THREAD_ENCODE_CHARS, True)) == [THREAD_ENCODE_CHARS, 1]
    assert asyncio.run(ctx.encode("y" * (THREAD_ENCODE_CHARS + 1), False)) == [THREAD_ENCODE_CHARS + 1, 0]
    assert tok.encode_threads == [True, True, True, False]  # the longer one off the event loop
    assert _refusal(context(None).encode, "x", True, "input") == (
        400,
        "input: this model has no tokenizer; send token ids",
        "input",
    )


def test_check_length_leaves_room_to_generate_in_the_model_and_the_cache():
    ctx = context(Tok())  # max_model_len 20; 3 pages of 4 tokens: 11 prompt tokens + 1 generated fit
    ctx.check_length(list(range(11)))
    msg = "prompt: 12 tokens need more KV pages than the cache holds (3 of 4 tokens)"
    assert _refusal(ctx.check_length, list(range(12))) == (413, msg, "prompt")
    ctx.llm.pool.num_pages = 100
    ctx.check_length(list(range(19)))
    msg = "prompt: 20 tokens leave no room to generate within max_model_len 20"
    assert _refusal(ctx.check_length, list(range(20))) == (413, msg, "prompt")
    msg = "messages: 21 tokens leave no room to generate within max_model_len 20"
    assert _refusal(ctx.check_length, list(range(21)), "messages") == (413, msg, "messages")


def test_submit_checks_every_prompt_then_queues_them_all():
    ctx = context(Tok(), max_queue_len=2)
    params = SimpleNamespace(structured=None)
    assert asyncio.run(ctx.submit([[1], [2, 3]], params, "r1")) == "GEN"
    assert ctx.engine.calls == [("validate", [1]), ("validate", [2, 3]), ("generate", [[1], [2, 3]], "r1")]
    ctx.engine.calls.clear()
    assert asyncio.run(ctx.submit([[4]], SimpleNamespace(structured="SPEC"), "r2", "messages")) == "GEN"
    assert ctx.engine.calls == [("compile", "SPEC"), ("validate", [4]), ("generate", [[4]], "r2")]
    ctx.engine.calls.clear()
    msg = "prompt: 3 prompts in one request exceed max_queue_len 2"
    assert _refusal(ctx.submit, [[1]] * 3, params, "r3") == (400, msg, "prompt")
    msg = "messages: 12 tokens need more KV pages than the cache holds (3 of 4 tokens)"
    assert _refusal(ctx.submit, [[1], [1] * 12], params, "r4", "messages") == (413, msg, "messages")
    assert ctx.engine.calls == [("validate", [1])]  # nothing queued


@pytest.mark.parametrize(
    "error,refusal",
    [
        (ValueError("max_tokens: 99 is too many"), (400, "max_tokens: 99 is too many", "max_tokens")),
        (ValueError("the stop strings: too many"), (400, "the stop strings: too many", None)),
        (ValueError("no field named"), (400, "no field named", None)),
        (OverflowError("256 waiting"), (503, "server overloaded: 256 waiting; retry later", None)),
        (EngineDeadError("the engine stopped: rank 1 died"), (503, "the engine stopped: rank 1 died", None)),
    ],
)
def test_submit_turns_the_engine_refusals_into_api_errors(error, refusal):
    ctx = context(Tok())
    ctx.engine.fail = error
    assert _refusal(ctx.submit, [[1]], SimpleNamespace(structured=None), "r") == refusal


def test_token_texts():
    assert context(Tok()).token_texts([5, 9]) == ["<5:False>", "<9:False>"]
    assert context(Tok()).token_texts([5, 9], as_ids=True) == ["token_id:5", "token_id:9"]
    assert context(None).token_texts([5, 9]) == ["5", "9"]


def test_sse_frames_compact_json_with_unicode_kept():
    assert sse({"a": "é", "b": [1, 2]}) == 'data: {"a":"é","b":[1,2]}\n\n'


async def _events(items, error=None):
    for x in items:
        yield x
    if error is not None:
        raise error


def _asgi(app) -> tuple[list[dict], bytes]:
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "path": "/"}, HTTPRequest([]).receive, send))
    return sent, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_event_stream_sends_sse_and_aborts_its_requests_when_it_ends():
    gen = Gen([])
    sent, body = _asgi(EventStream(_events(["data: 1\n\n", "data: 2\n\n"]), gen))
    headers = dict(sent[0]["headers"])
    assert sent[0]["status"] == 200 and headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache" and headers[b"x-accel-buffering"] == b"no"
    assert body == b"data: 1\n\ndata: 2\n\n" and gen.aborts == 1


def test_event_stream_failure_ends_with_an_error_event_and_done(monkeypatch, caplog):
    monkeypatch.setattr(serving, "new_error_id", lambda: "err-1")
    gen = Gen([])
    with caplog.at_level("ERROR", logger="mlaserve.server"):
        _, body = _asgi(EventStream(_events(["data: 1\n\n"], RuntimeError("bug")), gen))
    err = {"message": "internal error err-1: the server log holds the details under this id"}
    err |= {"type": "server_error", "param": None, "code": 500}
    assert body.decode() == "data: 1\n\n" + sse({"error": err}) + "data: [DONE]\n\n" and gen.aborts == 1
    assert caplog.messages == ["err-1: a streamed response failed"]
    # a dead rank's account is public: it follows the id
    _, body = _asgi(EventStream(_events([], EngineDeadError("rank 1 died", public=True)), gen))
    msg = json.loads(body.decode().split("\n\n")[0].removeprefix("data: "))["error"]["message"]
    assert msg == "internal error err-1: the server log holds the details under this id; rank 1 died"


def test_event_stream_aborts_when_the_client_is_gone():
    gen = Gen([])

    async def send(message):
        raise OSError("connection reset")

    with pytest.raises(OSError):
        asyncio.run(EventStream(_events(["data: 1\n\n"]), gen)({"type": "http"}, HTTPRequest([]).receive, send))
    assert gen.aborts == 1


def test_collect_gathers_every_event_by_prompt_index():
    gen = Gen([(0, "a"), (1, "b"), (0, "c")])
    req = HTTPRequest([], messages=[{"type": "http.request"}])  # a message that is not a disconnect, then silence
    assert asyncio.run(collect(req, gen)) == {0: ["a", "c"], 1: ["b"]} and gen.aborts == 1


def test_collect_gives_up_when_the_client_leaves_first():
    gen = Gen([(0, "a")], hang=True)
    req = HTTPRequest([], messages=[{"type": "http.request"}, {"type": "http.disconnect"}])
    assert asyncio.run(collect(req, gen)) is None and gen.aborts == 1


def test_collect_raises_an_engine_failure():
    gen = Gen([(0, "a")], error=EngineDeadError("the engine stopped"))
    with pytest.raises(EngineDeadError, match="^the engine stopped$"):
        asyncio.run(collect(HTTPRequest([]), gen))
    assert gen.aborts == 1
