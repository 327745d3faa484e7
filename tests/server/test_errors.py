"""Every bad request gets an OpenAI-style JSON error with 400, 404 or 413 whose message names the field; the server
keeps serving. BAD is also the abuse mix of test_abuse.py."""

import json

import httpx
import pytest

from .conftest import assert_idle_no_leak

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
# (name, path, body: dict or raw bytes, status, the field the message must name)
BAD = [
    ("bad json", C, b'{"prompt": "x",', 400, "body"),
    ("not json", C, b"\xff\xfe garbage", 400, "body"),
    ("empty body", C, b"", 400, "body"),
    ("json array", C, b"[1, 2]", 400, "body"),
    ("NaN", C, b'{"prompt": "x", "temperature": NaN}', 400, "body"),
    ("deep nesting", C, b"[" * 100000 + b"]" * 100000, 400, "body"),
    ("no prompt", C, {"max_tokens": 4}, 400, "prompt"),
    ("prompt wrong type", C, {"prompt": 12}, 400, "prompt"),
    ("prompt mixed list", C, {"prompt": [1, "a"]}, 400, "prompt"),
    ("prompt float ids", C, {"prompt": [1.5, 2.0]}, 400, "prompt"),
    ("null prompt", C, {"prompt": None}, 400, "prompt"),
    ("empty id list", C, {"prompt": []}, 400, "prompt"),
    ("token id past vocab", C, {"prompt": [1, 2, 512]}, 400, "prompt"),
    ("negative token id", C, {"prompt": [1, -3]}, 400, "prompt"),
    ("huge token id", C, {"prompt": [10**30]}, 400, "prompt"),
    ("unknown model", C, {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("huge max_tokens", C, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("zero max_tokens", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("negative max_tokens", C, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens string", C, {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("max_tokens float", C, {"prompt": "x", "max_tokens": 8.5}, 400, "max_tokens"),
    ("negative temperature", C, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("temperature string", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above 1", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_k negative", C, {"prompt": "x", "top_k": -7}, 400, "top_k"),
    ("top_k huge", C, {"prompt": "x", "top_k": 10**20}, 400, "top_k"),
    ("min_p above 1", C, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("seed huge", C, {"prompt": "x", "seed": 10**30}, 400, "seed"),
    ("seed string", C, {"prompt": "x", "seed": "1"}, 400, "seed"),
    ("logprobs too many", C, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("n zero", C, {"prompt": "x", "n": 0}, 400, "n"),
    ("n huge", C, {"prompt": "x", "n": 100000}, 400, "n"),
    ("best_of below n", C, {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("logprobs above max_logprobs", C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("prompt_logprobs above max_logprobs", C, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("presence_penalty range", C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency_penalty range", C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("repetition_penalty zero", C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit_bias key", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias range", C, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias outside vocab", C, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("allowed_token_ids empty", C, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("allowed_token_ids negative", C, {"prompt": "x", "allowed_token_ids": [3, -1]}, 400, "allowed_token_ids"),
    ("allowed_token_ids outside vocab", C, {"prompt": "x", "allowed_token_ids": [99999999]}, 400, "allowed_token_ids"),
    ("allowed_token_ids type", C, {"prompt": "x", "allowed_token_ids": ["3"]}, 400, "allowed_token_ids"),
    (
        "include_stop_str_in_output type",
        C,
        {"prompt": "x", "include_stop_str_in_output": 1},
        400,
        "include_stop_str_in_output",
    ),
    ("min_tokens above max_tokens", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("suffix", C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("response_format type", C, {"prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("guided_json bad schema", C, {"prompt": "x", "guided_json": {"type": "foo"}}, 400, "guided_json"),
    ("guided_json not json", C, {"prompt": "x", "guided_json": "{nope"}, 400, "guided_json"),
    ("guided_regex unclosed", C, {"prompt": "x", "guided_regex": "[a-"}, 400, "guided_regex"),
    ("guided_choice empty", C, {"prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ("guided_grammar bad", C, {"prompt": "x", "guided_grammar": "root ::= ("}, 400, "guided_grammar"),
    ("two structured kinds", C, {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
    ("structural_tag", C, {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, 400, "structured_outputs"),
    ("beam search", C, {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ("stop wrong type", C, {"prompt": "x", "stop": 5}, 400, "stop"),
    ("empty stop", C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("negative stop id", C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("stream not bool", C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (
        "stream_options type",
        C,
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
        400,
        "stream_options.include_usage",
    ),
    ("ignore_eos type", C, {"prompt": "x", "ignore_eos": "true"}, 400, "ignore_eos"),
    ("1 MB prompt", C, {"prompt": "a" * (1 << 20)}, 413, "prompt"),
    ("too many prompt ids", C, {"prompt": [7] * 5000}, 413, "prompt"),
    ("body over the limit", C, b'{"prompt": "' + b"b" * (5 << 20) + b'"}', 413, "body"),
    ("no messages", CHAT, {"model": "tiny"}, 400, "messages"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("content type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("chat unknown model", CHAT, {"model": "x", "messages": MSG}, 404, "model"),
    (
        "template kwargs clash",
        CHAT,
        {"messages": MSG, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
    ),
    ("chat top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 5}, 400, "top_logprobs"),
    ("chat top_logprobs too many", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice and a parser, as vLLM
    (
        "chat tools",
        CHAT,
        {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tool_choice",
    ),
    (
        "chat tool schema",
        CHAT,
        {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
        400,
        "tools",
    ),
    (
        "chat tool_choice unknown",
        CHAT,
        {"messages": MSG, "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400,
        "tool_choice",
    ),
    (
        "chat invalid json_schema",
        CHAT,
        {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
        400,
        "response_format",
    ),
    ("chat echo", CHAT, {"messages": MSG, "echo": True}, 400, "echo"),
    ("chat huge max_tokens", CHAT, {"messages": MSG, "max_completion_tokens": 10**9}, 400, "max_tokens"),
    ("chat long message", CHAT, {"messages": [{"role": "user", "content": "z" * 60000}]}, 413, "messages"),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, "path"),
]


def send(client: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


def check_error(r: httpx.Response, status: int, field: str) -> None:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["message"].startswith(field) or f"{field}:" in err["message"], err["message"]


@pytest.mark.parametrize("name,path,body,status,field", BAD, ids=[b[0] for b in BAD])
def test_bad_request(server, name, path, body, status, field):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        check_error(send(client, path, body), status, field)


def test_wrong_method_and_server_keeps_serving(server):
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "still here", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    m = assert_idle_no_leak(server)
    assert m["mlaserve:request_errors_total"] >= len(BAD)


def test_errors_are_json_when_streaming(server):
    """A refused streaming request gets the same JSON error, not a broken stream."""
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [999], "stream": True})
    assert r.status_code == 400 and "outside the vocabulary" in json.loads(r.text)["error"]["message"]
