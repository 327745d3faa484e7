"""Structured output through the official openai client on the tiny random model: a json_schema response parses and
validates (greedy, seeded sampling, streamed, n=2), guided_choice gives one of the choices, guided_regex and
structured_outputs match, json_object gives an object; an invalid schema is a 400 naming the field."""

from __future__ import annotations

import json
import re

import openai
import pytest

from .conftest import assert_idle_no_leak

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
}
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MSG = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)], ids=["greedy", "sampled"])
def test_chat_json_schema_validates(server, client, sampling):
    r = client.chat.completions.create(model="tiny", messages=MSG, response_format=RF, max_tokens=60, **sampling)
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert_idle_no_leak(server)


def test_chat_json_schema_streamed_and_n(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MSG, response_format=RF, max_tokens=60, temperature=0.8, seed=3, n=2, stream=True
    )
    texts = {0: "", 1: ""}
    for ev in stream:
        for c in ev.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_guided_choice_regex_and_structured_outputs(client):
    choices = ["positive", "negative", "neutral"]
    r = client.completions.create(
        model="tiny", prompt="Sentiment:", max_tokens=10, temperature=0, extra_body={"guided_choice": choices}
    )
    assert r.choices[0].text in choices
    pattern = r"\d{3}-[A-Z]{2}"
    r = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=10, temperature=1.0, seed=1, extra_body={"guided_regex": pattern}
    )
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    r = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "(ab){1,3}c"}},
    )
    assert re.fullmatch("(ab){1,3}c", r.choices[0].text), r.choices[0].text
    r = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=40,
        temperature=0,
        extra_body={"guided_json": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}},
    )
    assert json.loads(r.choices[0].text) in ({"k": True}, {"k": False})


def test_chat_json_object_and_grammar(client):
    r = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    r = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        max_tokens=10,
        temperature=0,
        extra_body={"guided_grammar": 'root ::= ("yes" | "no") "."'},
    )
    assert r.choices[0].message.content in ("yes.", "no.")


def test_invalid_schema_is_a_400_naming_the_field(server, client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, response_format=bad, max_tokens=5)
    err = e.value.body
    assert err["param"] == "response_format" and err["message"].startswith("response_format: invalid JSON schema")
    assert ".cc" not in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"})
    assert e.value.body["param"] == "guided_regex"
    assert_idle_no_leak(server)
