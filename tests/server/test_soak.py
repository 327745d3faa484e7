"""benchmarks/soak.py's traffic, a few seconds of it against the test server: every kind is answered as expected
(no 5xx, no hang), and afterwards the server is idle with every KV page back and the same greedy ids."""

import asyncio

from benchmarks import soak

from .conftest import assert_idle_no_leak


def test_soak_traffic_briefly(server):
    before = soak.greedy_ids(server.url)
    actions = {k: w for k, w in soak.ACTIONS.items() if k != "fill"}  # a fill runs to max_model_len: minutes here
    run = asyncio.run(soak.traffic(server.url, 4, workers=4, burst_n=24, burst_every=1.5, actions=actions))
    assert run["num_unexpected"] == 0, run["unexpected"]
    assert run["bursts"] and run["counts"]["burst"]["ok"] == 24 * len(run["bursts"])
    assert {"stream", "plain", "fields", "abort", "bad"} <= set(run["counts"]), run["counts"]
    idle = soak.wait_idle(server.url, timeout=60)
    assert idle["kv_cache_pages_used"] == 0 and idle["num_requests_running"] == 0
    assert_idle_no_leak(server)
    assert soak.greedy_ids(server.url) == before
