"""Soak: `mlaserve serve` (the default model on the CPU) under minutes of mixed traffic, then the checks that nothing
leaked or drifted.

Traffic, from --workers clients at once: streamed and plain completions and chats (greedy and sampled), vLLM's extra
request fields (allowed_token_ids, bad_words, include_stop_str_in_output, truncate_prompt_tokens, echo with max_tokens
0, continue_final_message) and prefix-cache resets, aborts (clients that disconnect mid-stream or before the answer),
bad inputs (they must get a 4xx JSON error), requests larger than max_model_len (a 400), requests that fill the KV
cache, and every --burst-every seconds a burst of --burst concurrent requests. Afterwards: KV pages in use, running
and waiting requests back to zero (from /metrics), the server's RSS within 5 % of what it was after the warm-up, the
same greedy ids for the same prompts as before, no unexpected status (5xx, a hang) and no traceback in the server log.
Writes benchmarks/results/soak_cpu_<date>.json.

    PYTHONPATH=$PWD python benchmarks/soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx

from mlaserve.bench.metrics import parse_prometheus

C, CHAT = "/v1/completions", "/v1/chat/completions"
# A cache of 1,024 tokens, smaller than the model's max_model_len: lowering it, preemption and skip-ahead all run.
# the default model is a code model with no chat template: the chat traffic renders through this one
CHAT_TEMPLATE = "{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}# assistant:"
SERVER_ARGS = f"--num-pages 64 --page-size 16 --chat-template {shlex.quote(CHAT_TEMPLATE)}"
GREEDY_PROMPTS = [f"{w} " * k for w, k in (("the", 3), ("soak", 5), ("page", 7), ("zero", 2), ("burst", 11))]
BAD = [
    b'{"prompt": "\\ud800", "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "x\\udfff"}]}',
    b'{"prompt": "x",',
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": [1, 2, 99999999]}',
    b'{"prompt": "x", "model": "nope"}',
    b'{"prompt": "x", "temperature": "hot"}',
    b"[1, 2]",
]
# kind -> weight; a fill holds the whole cache for about max_model_len steps, so it is rarer
ACTIONS = {"stream": 4, "plain": 3, "chat": 2, "fields": 2, "abort": 3, "bad": 2, "oversized": 1, "fill": 0.25}


class Tally:
    """Per kind: answered as expected, refused as expected (a 4xx the input called for), overloaded (503) and
    unexpected (anything else, with the first few kept)."""

    def __init__(self):
        self.counts: dict[str, dict[str, int]] = {}
        self.unexpected: list[str] = []

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        c = self.counts.setdefault(kind, {"ok": 0, "refused": 0, "overloaded": 0, "unexpected": 0})
        c[outcome] += 1
        if outcome == "unexpected" and len(self.unexpected) < 20:
            self.unexpected.append(f"{kind}: {detail[:300]}")

    @property
    def num_unexpected(self) -> int:
        return sum(c["unexpected"] for c in self.counts.values())


def _prompt(rng: random.Random) -> str:
    return " ".join(
        rng.choice(("soak", "page", "grow", "zero", "burst", "the", "a", "cache")) for _ in range(rng.randint(1, 40))
    )


async def _stream(client: httpx.AsyncClient, path: str, body: dict, stop_after: int | None = None) -> str:
    """-> the last finish_reason, "aborted" when we disconnected after stop_after events, or "HTTP <status> ..."."""
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code} {(await r.aread())[:200]!r}"
        reason, events = None, 0
        async for line in r.aiter_lines():
            if not line.startswith("data:") or "[DONE]" in line:
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                return f"error event {ev['error']}"
            events += 1
            reason = ev["choices"][0]["finish_reason"] if ev["choices"] else reason
            if stop_after is not None and events >= stop_after:
                return "aborted"  # leaving the block closes the connection: the server must abort the request
        return str(reason)


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random, max_model_len: int, tally: Tally) -> None:
    sampled = {"temperature": rng.choice((0, 0.8)), "max_tokens": rng.randint(1, 48)}
    try:
        if kind == "stream":
            reason = await _stream(client, C, {"prompt": _prompt(rng), **sampled})
            tally.add(kind, "ok" if reason in ("stop", "length") else "unexpected", reason)
        elif kind == "chat":
            msgs = [{"role": "user", "content": _prompt(rng)}]
            if rng.random() < 0.5:
                reason = await _stream(client, CHAT, {"messages": msgs, **sampled})
                tally.add(kind, "ok" if reason in ("stop", "length") else "unexpected", reason)
            else:
                r = await client.post(CHAT, json={"messages": msgs, **sampled})
                tally.add(kind, "ok" if r.status_code == 200 else "unexpected", f"{r.status_code} {r.text}")
        elif kind == "fields":  # vLLM's extra fields, one a request, and the prefix-cache reset
            await _fields(client, rng, sampled, tally)
        elif kind == "plain":
            r = await client.post(C, json={"prompt": _prompt(rng), "n": rng.choice((1, 1, 2)), **sampled})
            tally.add(kind, "ok" if r.status_code == 200 else "unexpected", f"{r.status_code} {r.text}")
        elif kind == "abort":
            body = {"prompt": _prompt(rng), "max_tokens": 200, "ignore_eos": True}
            if rng.random() < 0.5:
                reason = await _stream(client, C, body, stop_after=rng.randint(1, 3))
                tally.add(kind, "ok" if reason in ("aborted", "length") else "unexpected", reason)
            else:  # gone before the answer
                try:
                    await asyncio.wait_for(client.post(C, json=body), timeout=rng.uniform(0.01, 0.3))
                except asyncio.TimeoutError:
                    pass
                tally.add(kind, "ok")
        elif kind == "bad":
            r = await client.post(C if b"messages" not in (b := rng.choice(BAD)) else CHAT, content=b)
            ok = 400 <= r.status_code < 500 and "error" in r.json()
            tally.add(kind, "refused" if ok else "unexpected", f"{b!r} -> {r.status_code} {r.text}")
        elif kind == "oversized":
            body = rng.choice(
                ({"prompt": "grow grow grow", "max_tokens": max_model_len + 1}, {"prompt": [7] * (max_model_len + 5)})
            )
            r = await client.post(C, json=body)
            ok = r.status_code in (400, 413) and "max_model_len" in r.json()["error"]["message"]
            tally.add(kind, "refused" if ok else "unexpected", f"{r.status_code} {r.text}")
        elif kind == "fill":  # the request: as long as the cache allows, to the end
            reason = await _stream(client, C, {"prompt": "grow grow grow", "max_tokens": None, "ignore_eos": True})
            tally.add(kind, "ok" if reason == "length" else "unexpected", reason)
        else:
            raise ValueError(f"unknown traffic kind {kind!r}")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        tally.add(kind, "unexpected", repr(e))


async def _fields(client: httpx.AsyncClient, rng: random.Random, sampled: dict, tally: Tally) -> None:
    """One request with one of vLLM's extra fields (streamed or not), or a prefix-cache reset: 200, or a 409 while
    other requests run."""
    pick = rng.choice(("allowed", "bad_words", "stop", "truncate", "echo_only", "continue", "reset"))
    if pick == "reset":
        r = await client.post("/reset_prefix_cache")
        ok = r.status_code == 200 or (r.status_code == 409 and "running or waiting" in r.text)
        tally.add("fields", "ok" if ok else "unexpected", f"reset: {r.status_code} {r.text}")
        return
    path, body = C, {"prompt": _prompt(rng), **sampled}
    if pick == "allowed":
        body["allowed_token_ids"] = rng.sample(range(2, 512), 5)
    elif pick == "bad_words":
        body["bad_words"] = rng.sample(("soak", "page", "grow", " the", "a"), 2)
    elif pick == "stop":
        body.update(stop=[rng.choice(("a", "e", " "))], include_stop_str_in_output=True)
    elif pick == "truncate":
        body["truncate_prompt_tokens"] = rng.choice((-1, 1, 8))
    elif pick == "echo_only":
        body.update(max_tokens=0, echo=True, logprobs=1)
    else:
        path, body = CHAT, {**sampled, "continue_final_message": True}
        body["messages"] = [{"role": "user", "content": _prompt(rng)}, {"role": "assistant", "content": "def"}]
    if rng.random() < 0.5 and pick != "echo_only":
        reason = await _stream(client, path, body)
        tally.add("fields", "ok" if reason in ("stop", "length") else "unexpected", f"{pick}: {reason}")
    else:
        r = await client.post(path, json=body)
        tally.add("fields", "ok" if r.status_code == 200 else "unexpected", f"{pick}: {r.status_code} {r.text}")


async def burst(client: httpx.AsyncClient, n: int, tally: Tally) -> dict:
    """n requests at once (half streamed); each must be answered (503 counts as overloaded, not a failure)."""
    t0 = time.monotonic()

    async def req(i: int) -> None:
        body = {"prompt": f"burst {i} " * (1 + i % 7), "max_tokens": 8, "temperature": 0}
        try:
            if i % 2:
                reason = await _stream(client, C, body)
                out = "ok" if reason in ("stop", "length") else "overloaded" if reason.startswith("HTTP 503") else None
                tally.add("burst", out or "unexpected", reason)
            else:
                r = await client.post(C, json=body)
                out = {200: "ok", 503: "overloaded"}.get(r.status_code, "unexpected")
                tally.add("burst", out, f"{r.status_code} {r.text}")
        except httpx.HTTPError as e:
            tally.add("burst", "unexpected", repr(e))

    await asyncio.gather(*[req(i) for i in range(n)])
    return {"n": n, "seconds": round(time.monotonic() - t0, 2)}


async def traffic(
    url: str, seconds: float, workers: int, burst_n: int, burst_every: float, seed: int = 0, actions: dict = ACTIONS
) -> dict:
    """Mixed traffic for `seconds` (actions: kind -> weight); -> the tally and the bursts."""
    tally, bursts = Tally(), []
    limits = httpx.Limits(max_connections=burst_n + workers + 8, max_keepalive_connections=workers + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        max_model_len = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
        end = time.monotonic() + seconds
        kinds, weights = list(actions), list(actions.values())

        async def worker(w: int) -> None:
            rng = random.Random(seed * 1000 + w)
            while time.monotonic() < end:
                await one(client, rng.choices(kinds, weights)[0], rng, max_model_len, tally)

        async def bursts_loop() -> None:
            while time.monotonic() + burst_every < end:
                await asyncio.sleep(burst_every)
                bursts.append(await burst(client, burst_n, tally))

        await asyncio.gather(*[worker(w) for w in range(workers)], bursts_loop())
    return {
        "counts": tally.counts,
        "unexpected": tally.unexpected,
        "num_unexpected": tally.num_unexpected,
        "bursts": bursts,
    }


def greedy_ids(url: str) -> list[list[int]]:
    with httpx.Client(base_url=url, timeout=120) as client:
        out = []
        for p in GREEDY_PROMPTS:
            body = {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            r = client.post(C, json=body)
            r.raise_for_status()
            out.append(r.json()["choices"][0]["token_ids"])
        return out


def wait_idle(url: str, timeout: float = 120) -> dict:
    """The /metrics gauges once running, waiting and KV pages in use are all zero (or what they are at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = parse_prometheus(httpx.get(f"{url}/metrics", timeout=30).text)
        keys = ("mlaserve:num_requests_running", "mlaserve:num_requests_waiting", "mlaserve:kv_cache_pages_used")
        gauges = {k.split(":")[1]: m.get(k) for k in (*keys, "mlaserve:kv_cache_pages_total")}
        if all(m.get(k) == 0 for k in keys) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.2)


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=8, help="clients sending the mixed traffic at once")
    ap.add_argument("--burst", type=int, default=512, help="requests in one burst")
    ap.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts")
    ap.add_argument("--server-args", default=SERVER_ARGS, help="flags for `mlaserve serve` (default: %(default)s)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    port = _free_port()
    cmd = [sys.executable, "-m", "mlaserve", "serve", "--port", str(port), *shlex.split(args.server_args)]
    log_path = os.path.join(args.out, "soak_server.log")
    os.makedirs(args.out, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            result = _soak(url, server.pid, args)
        finally:
            server.send_signal(signal.SIGINT)
            rc = server.wait(timeout=60)
    with open(log_path) as f:
        text = f.read()
    os.remove(log_path)
    result["server"] = {
        "command": " ".join(cmd[1:]),
        "exit_code": rc,
        "tracebacks_in_log": text.count("Traceback"),
        "lowered_max_model_len": next((ln.split("WARNING ")[-1] for ln in text.splitlines() if "lowered" in ln), None),
    }
    checks = result["checks"]
    checks["no_traceback_in_log"] = result["server"]["tracebacks_in_log"] == 0
    checks["clean_exit"] = rc == 0
    result["pass"] = all(checks.values())
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    path = os.path.join(args.out, f"soak_cpu_{date}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("checks", "pass")}, indent=1))
    print(f"wrote {path}")
    return 0 if result["pass"] else 1


def _soak(url: str, pid: int, args) -> dict:
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {url} did not come up")
        time.sleep(0.5)
    rss_start = rss_kb(pid)
    before = greedy_ids(url)
    # warm-up: every kind of traffic once and one burst, so allocator pools and caches have grown before the baseline
    warm = asyncio.run(traffic(url, 20, args.workers, args.burst, 5, seed=args.seed + 1))
    wait_idle(url)
    rss_warm = rss_kb(pid)
    t0 = time.monotonic()
    run = asyncio.run(traffic(url, args.minutes * 60, args.workers, args.burst, args.burst_every, seed=args.seed))
    seconds = time.monotonic() - t0
    idle = wait_idle(url)
    rss_end = rss_kb(pid)
    after = greedy_ids(url)
    growth = (rss_end - rss_warm) / rss_warm
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "command": "python benchmarks/soak.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "minutes": args.minutes,
        "seconds": round(seconds, 1),
        "workers": args.workers,
        "burst": args.burst,
        "burst_every_s": args.burst_every,
        "warm_up": {"counts": warm["counts"], "num_unexpected": warm["num_unexpected"]},
        **run,
        "idle_after": idle,
        "rss_kb": {"start": rss_start, "after_warm_up": rss_warm, "end": rss_end},
        "rss_growth": round(growth, 4),
        "greedy_ids": before,
        "checks": {
            "no_unexpected_answers": run["num_unexpected"] == 0 and warm["num_unexpected"] == 0,
            "idle_after": idle["num_requests_running"] == 0
            and idle["num_requests_waiting"] == 0
            and idle["kv_cache_pages_used"] == 0,
            "rss_growth_below_5pct": growth < 0.05,
            "greedy_ids_identical": before == after,
        },
    }


if __name__ == "__main__":
    sys.exit(main())
