"""tool_choice "required" and a named function force tool calls, as vLLM does: the output runs under the JSON schema
built from the tools (structured output) and comes back as `tool_calls` with ids and finish_reason "tool_calls",
streamed (the arguments in fragments as they are generated) and not, through the official openai client on the tiny
random model. Refused beside response_format."""

from __future__ import annotations

import json

import openai
import pytest

from mlaserve.server.chat_tools import forced_schema

from .conftest import assert_idle_no_leak

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"$ref": "#/$defs/digit"}},
            "required": ["a", "b"],
            "additionalProperties": False,
            "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}},
        },
    },
}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "Call a tool."}]
NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _check_calls(calls: list[tuple[str, str, str]], only: str | None = None):
    """(id, name, arguments) per call: ids unique, names among the tools, arguments valid for the tool's schema."""
    assert calls
    assert len({c[0] for c in calls}) == len(calls) and all(c[0] for c in calls)
    for _, name, args in calls:
        assert name in PARAMS and (only is None or name == only)
        jsonschema.validate(json.loads(args), PARAMS[name])


def _stream(client, **kw) -> tuple[str, list[tuple[str, str, str]], str | None, list[int]]:
    """-> (content, (id, name, arguments) per call, finish_reason, how many deltas carried each call's arguments)."""
    content, calls, finish, pieces = "", {}, None, {}
    for ev in client.chat.completions.create(stream=True, **kw):
        for c in ev.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, ["", "", ""])
                assert not (tc.id and slot[0]), "a call's id comes once, in its first delta"
                slot[0] = tc.id or slot[0]
                slot[1] = (tc.function and tc.function.name) or slot[1]
                slot[2] += (tc.function and tc.function.arguments) or ""
                pieces[tc.index] = pieces.get(tc.index, 0) + bool(tc.function and tc.function.arguments)
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, [pieces[i] for i in sorted(calls)]


def test_forced_schema_forms():
    assert forced_schema(TOOLS, "get_weather") == PARAMS["get_weather"]
    s = forced_schema(TOOLS, "required")
    assert s["minItems"] == 1 and s["$defs"] == {"digit": {"type": "integer", "minimum": 0, "maximum": 9}}
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}], s)
    for bad in ([], [{"name": "add", "parameters": {"city": "Paris"}}], [{"name": "x", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, s)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5)], ids=["greedy", "sampled"])
def test_named_function_is_one_call(server, client, sampling):
    r = client.chat.completions.create(
        model="tiny", messages=MSG, tools=TOOLS, tool_choice=NAMED, max_tokens=80, **sampling
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None
    calls = [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert len(calls) == 1
    _check_calls(calls, only="add")
    assert_idle_no_leak(server)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=11)], ids=["greedy", "sampled"])
def test_required_gives_calls(client, sampling):
    r = client.chat.completions.create(
        model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=200, **sampling
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    _check_calls([(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls])


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_calls_streamed(server, client, choice):
    kw = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0)
    content, calls, finish, pieces = _stream(client, **kw)
    assert finish == "tool_calls" and content == ""
    _check_calls(calls, only="add" if choice is NAMED else None)
    assert all(n > 3 for n in pieces), pieces  # the arguments stream as they are generated (vLLM), not at the end
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [(n, a) for _, n, a in calls] == [(t.function.name, t.function.arguments) for t in whole]
    assert_idle_no_leak(server)


def test_forced_call_with_response_format_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=MSG,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
            max_tokens=4,
        )
    assert e.value.status_code == 400
    assert "tool_choice" in str(e.value) and "response_format" in str(e.value)
