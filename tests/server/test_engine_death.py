"""The engine thread dying (a step raises) fails every waiting request with a clear error, makes /health fail, and
brings the server down with status 1 and a message: never a hang."""

import asyncio
import json
import logging
import time

import httpx
import pytest

from .conftest import start_server


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
        eid = msg.split()[2].rstrip(":")
        logged = [r for r in caplog.records if eid in r.getMessage()]
        assert logged and "injected step failure" in str(logged[0].exc_info[1]), eid
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
    assert health.status_code == 503 and "injected step failure" in health.json()["error"]["message"]
    assert refused.status_code == 503 and "engine" in refused.json()["error"]["message"]
    assert health.headers["retry-after"] == refused.headers["retry-after"] == "1"
