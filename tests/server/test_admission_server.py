"""Through the real server: a request larger than the KV cache is refused (400 naming the numbers) and one that fills
the cache is answered within seconds while later requests are served, with every page back; bad unicode is a 400
naming the field; a 500 carries an error id only, the log holds the traceback under it, and the connection stays
open."""

import asyncio
import http.client
import json
import logging
import time
from urllib.parse import urlparse

import httpx
import pytest

from .conftest import assert_idle_no_leak, start_server

JSON = {"content-type": "application/json"}
C, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def small_cache(tiny_ckpt):
    """The server of the report: 16 pages of 16 tokens (256), smaller than the model's max_model_len."""
    run = start_server(tiny_ckpt, page_size=16, num_pages=16)
    yield run
    assert run.stop() == 0


def test_small_cache_lowers_max_model_len(small_cache):
    card = httpx.get(f"{small_cache.url}/v1/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] == 256


def test_request_larger_than_the_cache_is_refused_at_once(small_cache):
    t0 = time.monotonic()
    r = httpx.post(
        f"{small_cache.url}{C}", json={"prompt": "grow grow grow", "max_tokens": 300, "ignore_eos": True}, timeout=30
    )
    assert time.monotonic() - t0 < 5
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens"
    msg = err["message"]
    assert msg.startswith("max_tokens: 300 plus the prompt's ") and "max_model_len 256" in msg
    assert "the KV cache holds 256 tokens (16 pages of 16)" in msg
    r = httpx.post(f"{small_cache.url}{C}", json={"prompt": "later", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert_idle_no_leak(small_cache)


def test_requests_filling_the_cache_are_all_answered(small_cache):
    """Three streams that each nearly fill the cache (preempted and recomputed in turn) and one with no max_tokens
    all finish by length within seconds; a later request is served and every page comes back."""

    async def main():
        async with httpx.AsyncClient(base_url=small_cache.url, timeout=60) as client:

            async def stream(body):
                async with client.stream("POST", C, json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    lines = [ln async for ln in r.aiter_lines() if ln.startswith("data:") and "[DONE]" not in ln]
                return [json.loads(ln[5:]) for ln in lines]

            grow = {"prompt": "grow grow grow", "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(
                *[stream(grow) for _ in range(3)],
                stream({"prompt": "grow grow grow", "max_tokens": None, "ignore_eos": True}),
            )

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - t0 < 60
    for events in results:
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    n = sum(len(e["choices"][0]["text"]) > 0 for e in results[3])
    assert n > 0
    r = httpx.post(f"{small_cache.url}{C}", json={"prompt": "later", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200
    assert_idle_no_leak(small_cache)
    assert small_cache.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "path,body,field",
    [
        (C, b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
        (C, b'{"prompt": ["ok", "x\\udfff"], "max_tokens": 2}', "prompt[1]"),
        (C, b'{"prompt": "ok", "stop": ["\\ud83d"]}', "stop[0]"),
        (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        ("/tokenize", b'{"prompt": "\\udc00"}', "prompt"),
    ],
)
def test_lone_surrogate_is_a_400_naming_the_field(server, path, body, field):
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 400 and err["param"] == field, err
        assert err["message"].startswith(f"{field}: not valid unicode"), err
        sock = conn.sock
        conn.request("POST", C, body=b'{"prompt": "\\u00e9t\\u00e9", "max_tokens": 2}', headers=JSON)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
        assert conn.sock is sock, "the keep-alive connection was dropped"
    finally:
        conn.close()


def test_500_has_an_error_id_and_the_log_the_traceback(server, monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("secret internals /home/someone/model")

    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        with monkeypatch.context() as m, caplog.at_level(logging.ERROR, logger="mlaserve.server"):
            m.setattr(server.engine, "validate", boom)
            conn.request("POST", C, body=json.dumps({"prompt": "x", "max_tokens": 2}), headers=JSON)
            r = conn.getresponse()
            body = r.read().decode()
        assert r.status == 500
        err = json.loads(body)["error"]
        assert "secret" not in body and "RuntimeError" not in body and "/home" not in body
        eid = err["message"].split()[2].rstrip(":")
        assert eid.startswith("err-") and err["code"] == 500
        rec = [x for x in caplog.records if eid in x.getMessage()]
        assert rec and rec[0].exc_info and "secret internals" in str(rec[0].exc_info[1])
        sock = conn.sock
        conn.request("POST", C, body=json.dumps({"prompt": "x", "max_tokens": 2}), headers=JSON)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
        assert conn.sock is sock, "the keep-alive connection was dropped"
    finally:
        conn.close()
    assert_idle_no_leak(server)
