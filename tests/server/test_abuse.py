"""Abuse mixed with good traffic, all at once: every bad request of test_errors.BAD, clients that disconnect mid-stream
or mid-request, and good requests. Every good one completes with the offline greedy tokens, every bad one gets its
4xx naming the field, every disconnect aborts its request, and no KV page is leaked afterwards."""

import asyncio
import contextlib
import random

import httpx

from .conftest import assert_idle_no_leak, greedy_ids
from .test_errors import BAD

LONG = 3000  # max_tokens of the requests whose clients leave: far longer than the test runs, so only an abort ends them


async def _good_completion(client, prompt, n, stream):
    body = {
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    ids = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                ids += httpx.Response(200, content=line[5:]).json()["choices"][0]["token_ids"]
    return ids


async def _bad(client, path, body):
    if isinstance(body, bytes):
        return await client.post(path, content=body, headers={"content-type": "application/json"})
    return await client.post(path, json=body)


async def _leave_mid_stream(url, prompt, events: int):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        body = {"prompt": prompt, "max_tokens": LONG, "ignore_eos": True, "stream": True, "temperature": 0}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= events:
                    break  # leaving the block closes the connection mid-stream
    return "left"


def _generating(engine, prompt) -> bool:
    return any(
        s.req.prompt_token_ids == prompt and len(s.req.output_token_ids) >= 2 for s in list(engine.states.values())
    )


async def _leave_mid_request(url, prompt, engine):
    """A non-streaming request whose client leaves once the engine is generating for it."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        body = {"prompt": prompt, "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
        task = asyncio.ensure_future(client.post("/v1/completions", json=body))
        while not _generating(engine, prompt):
            assert not task.done(), "a 3000-token request finished before its client left"
            await asyncio.sleep(0.01)
        task.cancel()  # closes the connection
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return "left"


def test_abuse_mixed_with_good_traffic(server, offline):
    rng = random.Random(20260724)
    goods = [
        ([rng.randrange(260, 512) for _ in range(rng.randrange(4, 30))], rng.randrange(4, 12), i % 2 == 0)
        for i in range(16)
    ]
    want = [greedy_ids(offline, p, n, ignore_eos=True) for p, n, _ in goods]
    aborted_before = _aborts(server.url)
    n_leave = 8

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            jobs = [("good", i, _good_completion(client, *goods[i])) for i in range(len(goods))]
            jobs += [("bad", i, _bad(client, BAD[i][1], BAD[i][2])) for i in range(len(BAD))]
            jobs += [("leave", i, _leave_mid_stream(server.url, [1, 2, 3 + i], 2 + i)) for i in range(n_leave // 2)]
            jobs += [
                ("leave", i, _leave_mid_request(server.url, [4, 5, 6 + i], server.engine)) for i in range(n_leave // 2)
            ]
            rng.shuffle(jobs)
            results = await asyncio.gather(*(j[2] for j in jobs))
        return [(kind, i, res) for (kind, i, _), res in zip(jobs, results)]

    results = asyncio.run(main())
    assert len([r for r in results if r[0] == "bad"]) >= 50
    for kind, i, res in results:
        if kind == "good":
            assert res == want[i], f"good request {i} differs from offline"
        elif kind == "bad":
            _, _, _, status, field = BAD[i]
            assert res.status_code == status, (BAD[i][0], res.text[:200])
            assert field in res.json()["error"]["message"], (BAD[i][0], res.json())
        else:
            assert res == "left"
    assert_idle_no_leak(server, timeout=20)
    assert _aborts(server.url) - aborted_before == n_leave, "each client that left must abort its request"
    # and the server still serves
    assert asyncio.run(_once(server.url, goods[0])) == want[0]


def _aborts(url):
    return sum(v for k, v in _scrape_labelled(url).items() if "request_success_total" in k and "abort" in k)


def _scrape_labelled(url):
    text = httpx.get(f"{url}/metrics").text
    return {
        ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and not ln.startswith("#")
    }


async def _once(url, good):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await _good_completion(client, *good)
