"""The real server behind API keys: 401 on every /v1 route without a key (the openai client's own key works),
/health open; and no filesystem path in any response (/v1/models' root is the served name)."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from mlaserve.server.guard import HTTPLimits

from .conftest import start_server


@pytest.fixture(scope="module")
def keyed(tiny_ckpt):
    run = start_server(tiny_ckpt, limits=HTTPLimits(api_keys=("sk-test",)))
    yield run
    assert run.stop() == 0


AUTH = {"Authorization": "Bearer sk-test"}


def test_every_v1_route_needs_the_key(keyed):
    u = keyed.url
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/tiny", None),
        ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1, 2]}),
    ]:
        r = httpx.request(method, f"{u}{path}", json=body)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer" and r.json()["error"]["code"] == 401
        r = httpx.request(method, f"{u}{path}", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, (path, r.text)
    assert httpx.get(f"{u}/health").status_code == 200
    assert httpx.get(f"{u}/metrics").status_code == 200
    assert keyed.engine.pool.num_used == 0


def test_openai_client_with_key(keyed):
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-test", max_retries=0)
    out = good.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_no_path_in_any_response(keyed, tiny_ckpt):
    """The checkpoint's folder (absolute, and its parent) appears in no body or header."""
    folder = os.path.realpath(tiny_ckpt)
    needles = {folder, os.path.dirname(folder), tiny_ckpt}
    u = keyed.url
    card = httpx.get(f"{u}/v1/models", headers=AUTH).json()["data"][0]
    assert card["root"] == "tiny"
    responses = [
        httpx.get(f"{u}{p}", headers=AUTH) for p in ("/v1/models", "/v1/models/tiny", "/v1/models/x", "/version")
    ]
    responses += [httpx.get(f"{u}/health"), httpx.get(f"{u}/metrics"), httpx.get(f"{u}/v1/nothing", headers=AUTH)]
    for body in (
        {"prompt": "hello", "max_tokens": 2},
        {"prompt": [10**9], "max_tokens": 2},
        {"prompt": "x", "max_tokens": 10**6},
        {"prompt": "x", "model": "other"},
        {"prompt": "x", "stop": [""]},
    ):
        responses.append(httpx.post(f"{u}/v1/completions", json=body, headers=AUTH, timeout=60))
    responses.append(
        httpx.post(f"{u}/v1/chat/completions", json={"messages": [{"role": "bot"}]}, headers=AUTH, timeout=60)
    )
    responses.append(httpx.post(f"{u}/v1/completions", content=b"{not json", headers=AUTH))
    assert {r.status_code for r in responses} >= {200, 400, 404, 415}
    for r in responses:
        text = r.text + str(r.headers)
        for n in needles:
            assert n not in text, (r.request.url, text[:300])
