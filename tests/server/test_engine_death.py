"""The engine thread dying (a step raises) fails every waiting request with a clear error, makes /health fail, and
brings the server down with status 1 and a message: never a hang."""

import asyncio
import json
import logging
import re
import time

import httpx
import pytest

from mlaserve.distributed.launch import RankFailed

from .conftest import start_server


def assert_logged(caplog, msg: str, text: str) -> None:
    """msg quotes an error id ("internal error err-...: ..."); the log holds an exception with `text` under it."""
    m = re.search(r"internal error (err-[0-9a-f]{16}):", msg)
    assert m, msg
    logged = [r for r in caplog.records if m.group(1) in r.getMessage() and r.exc_info]
    assert logged and text in str(logged[0].exc_info[1]), (msg, [r.getMessage() for r in caplog.records])


def test_engine_failure_stops_the_server(tiny_ckpt, capfd, caplog):
    run = start_server(tiny_ckpt)
    eng = run.engine
    real_step = eng.step

    def failing_step():
        if len(eng.states) == 2 and eng.num_steps >= 4:  # both requests are in: fail mid-generation
            raise RuntimeError("injected step failure")
        return real_step()

    eng.step = failing_step

    async def main():
        async with httpx.AsyncClient(base_url=run.url, timeout=60) as client:
            body = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True}

            async def streamed():
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    return [
                        json.loads(x[5:])
                        for x in [ln async for ln in r.aiter_lines()]
                        if x.startswith("data:") and "[DONE]" not in x
                    ]

            return await asyncio.gather(client.post("/v1/completions", json=body), streamed())

    with caplog.at_level(logging.ERROR, logger="mlaserve.server"):
        plain, events = asyncio.run(main())
    # a 500 carries an error id, never the exception; the log holds the exception under that id
    for msg in (plain.json()["error"]["message"], events[-1]["error"]["message"]):
        assert msg.startswith("internal error err-") and "injected" not in msg, msg
        assert_logged(caplog, msg, "injected step failure")
    assert plain.status_code == 500

    run.thread.join(timeout=30)
    assert not run.thread.is_alive(), "the server did not exit after the engine died"
    assert run.result["rc"] == 1
    assert "the engine failed" in capfd.readouterr().err
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{run.url}/health", timeout=5)
    # the app itself (in-process) reports the dead engine on /health, and refuses new work with 503
    asgi = httpx.AsyncClient(transport=httpx.ASGITransport(app=run.server.app), base_url="http://app")

    async def after():
        async with asgi:
            return await asgi.get("/health"), await asgi.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})

    t0 = time.monotonic()
    health, refused = asyncio.run(after())
    assert time.monotonic() - t0 < 10
    # the 503s carry a generic message and the error id the log holds the failure under, never its text
    for res in (health, refused):
        msg = res.json()["error"]["message"]
        assert res.status_code == 503 and "engine has stopped" in msg and "injected" not in msg, msg
        assert_logged(caplog, msg, "injected step failure")
    assert health.headers["retry-after"] == refused.headers["retry-after"] == "1"


def test_rank_failure_503s_give_the_account_not_the_error_text(tiny_ckpt, caplog):
    """A dead rank's account (which rank, how it ended) reaches the client; its own error text (paths) stays in the
    log, under the id the 503 quotes."""
    run = start_server(tiny_ckpt)
    err = RankFailed(
        "rank 1 exited with code 1: OSError: /srv/secret/weights.bin",
        1,
        1,
        "tb",
        "rank 1 exited with code 1: it raised an error",
    )
    with caplog.at_level(logging.ERROR, logger="mlaserve.server"):
        run.server.rank_failed(err)
        run.thread.join(timeout=30)
    assert not run.thread.is_alive()
    asgi = httpx.AsyncClient(transport=httpx.ASGITransport(app=run.server.app), base_url="http://app")

    async def after():
        async with asgi:
            return await asgi.get("/health"), await asgi.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})

    for res in asyncio.run(after()):
        msg = res.json()["error"]["message"]
        assert res.status_code == 503 and "rank 1 exited with code 1: it raised an error" in msg, msg
        assert "/srv" not in msg and "OSError" not in msg, msg
        assert_logged(caplog, msg, "/srv/secret/weights.bin")
