"""Load: 64 concurrent streaming clients all complete; past --max-queue-len new requests get 503 while the accepted
ones complete, and nothing is leaked."""

import asyncio
import json
import random
import time

import httpx

from .conftest import assert_idle_no_leak, greedy_ids, start_server


async def _stream(client, body) -> tuple[int, list[int], dict | None]:
    """(status, streamed token ids, usage) of one streamed completion."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, [], json.loads(await r.aread())
        ids, usage, done = [], None, False
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            if line[5:].strip() == "[DONE]":
                done = True
                continue
            ch = json.loads(line[5:])
            usage = ch.get("usage") or usage
            ids += [t for c in ch["choices"] for t in c["token_ids"]]
        assert done, "stream ended without [DONE]"
        return 200, ids, usage


def test_64_concurrent_streams(server, offline):
    rng = random.Random(64)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(8, 40))] for _ in range(64)]

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            return await asyncio.gather(
                *(
                    _stream(
                        client,
                        {
                            "prompt": p,
                            "max_tokens": 16,
                            "temperature": 0,
                            "ignore_eos": True,
                            "stream": True,
                            "return_token_ids": True,
                            "stream_options": {"include_usage": True},
                        },
                    )
                    for p in prompts
                )
            )

    results = asyncio.run(main())
    assert all(status == 200 for status, _, _ in results), [r for r in results if r[0] != 200][:3]
    for (_, ids, usage), p in zip(results, prompts):
        assert len(ids) == 16 and usage["completion_tokens"] == 16 and usage["prompt_tokens"] == len(p)
    for i in (0, 31, 63):  # spot-check the batched greedy tokens against offline
        assert results[i][1] == greedy_ids(offline, prompts[i], 16, ignore_eos=True)
    assert_idle_no_leak(server)


def test_overload_gets_503(tiny_ckpt):
    """max_queue_len 3 and a slowed engine: of 12 simultaneous requests some are refused with 503 (OpenAI error
    JSON), every accepted one completes, and the server serves normally afterwards."""
    run = start_server(tiny_ckpt, max_queue_len=3)
    step = run.engine.step

    def slow_step():
        time.sleep(0.01)  # keep the first requests in the engine while the rest arrive
        return step()

    run.engine.step = slow_step
    try:

        async def main():
            async with httpx.AsyncClient(base_url=run.url, timeout=120) as client:
                body = {
                    "prompt": [5, 6, 7],
                    "max_tokens": 40,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_token_ids": True,
                }
                return await asyncio.gather(*(_stream(client, body) for _ in range(12)))

        results = asyncio.run(main())
        statuses = [s for s, _, _ in results]
        assert set(statuses) == {200, 503} and statuses.count(200) >= 3, statuses
        for status, ids, err in results:
            if status == 503:
                assert err["error"]["code"] == 503 and "max_queue_len" in err["error"]["message"]
            else:
                assert len(ids) == 40
        m = assert_idle_no_leak(run)
        assert m["mlaserve:request_errors_total"] == statuses.count(503)
        status, ids, _ = asyncio.run(_one(run.url))
        assert status == 200 and len(ids) == 20
    finally:
        assert run.stop() == 0


async def _one(url):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await _stream(
            client,
            {"prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True, "stream": True, "return_token_ids": True},
        )
