"""A speculative server (EAGLE3, random draft, K=1 N=2) against a plain one, through `bench serve` and
`bench compare`: identical texts and token ids; the bench's acceptance proxy agrees with the server's exact counts."""

import json

from mlaserve.cli import main
from mlaserve.models.make_random_draft import make_random_draft

from ..server.conftest import assert_idle_no_leak, start_server


def _bench(url, out, *extra):
    return main(
        [
            "bench",
            "serve",
            "--base-url",
            url,
            "--num-prompts",
            "8",
            "--max-concurrency",
            "8",
            "--input-len",
            "64",
            "--output-len",
            "48",
            "--seed",
            "20260724",
            "--num-warmups",
            "0",
            "--temperature",
            "0",
            "--ignore-eos",
            "--disable-tqdm",
            "--save-result",
            str(out),
            *extra,
        ]
    )


def _bench_twice(ckpt, spec, tmp_path, name):
    """Two protocol runs against one speculative server, which must end idle with no page leaked -> their files."""
    runs = [tmp_path / f"{name}-1.json", tmp_path / f"{name}-2.json"]
    run = start_server(ckpt, speculative_config=spec)
    try:
        for out in runs:
            assert _bench(run.url, out) == 0
        assert_idle_no_leak(run)
    finally:
        assert run.stop() == 0
    return runs


def test_spec_server_same_texts_as_plain(tiny_ckpt, tmp_path, capsys):
    draft = make_random_draft("tiny-eagle3", str(tmp_path / "draft"), target=tiny_ckpt, dtype="float32")
    plain, spec = tmp_path / "plain.json", tmp_path / "spec.json"
    for out, kw in ((plain, {}), (spec, dict(speculative_config={"draft_model": draft, "num_steps": 1}))):
        run = start_server(tiny_ckpt, **kw)
        try:
            assert _bench(run.url, out) == 0
            assert_idle_no_leak(run)
        finally:
            assert run.stop() == 0
    p, s = json.loads(plain.read_text()), json.loads(spec.read_text())
    assert [r["text"] for r in p["requests"]] == [r["text"] for r in s["requests"]]
    assert [r["output_token_ids"] for r in p["requests"]] == [r["output_token_ids"] for r in s["requests"]]
    # The server's exact accepted-token counts (usage and /metrics) agree with each other and with the proxy.
    assert s["accepted_tokens_agree"] is True
    assert s["accepted_tokens_usage"] == s["accepted_tokens_proxy"] == s["server_metrics"]["delta"]["accepted_tokens"]
    assert s["server_metrics"]["delta"]["draft_tokens"] > 0
    capsys.readouterr()
    rc = main(
        [
            "bench",
            "compare",
            "--baseline",
            str(plain),
            "--candidate",
            str(spec),
            "--save-result",
            str(tmp_path / "cmp.json"),
        ]
    )
    problems = json.loads((tmp_path / "cmp.json").read_text())["problems"]
    assert not [x for x in problems if "text differs" in x or "token ids differ" in x], problems
    assert rc == (1 if problems else 0)  # event vectors may differ: speculation carries 1 + accepted per event


def test_replay_server_reports_acceptance_per_position(tiny_ckpt, tmp_path, capsys):
    """A plain run records its greedy outputs (--save-replay); a REPLAY server (benchmark-only draft, K=2, miss
    rate 0.3, the EAGLE3 draft's forward running) gives the same texts, its per-position acceptance in usage and
    /metrics is exactly what the misses imply, and two runs of it are identical to `bench compare`."""
    from mlaserve.bench.prompts import random_prompts
    from mlaserve.spec.replay import read_recordings

    from .test_replay import expected_per_position

    draft = make_random_draft("tiny-eagle3", str(tmp_path / "draft"), target=tiny_ckpt, dtype="float32")
    rec = tmp_path / "replay.jsonl"
    plain = tmp_path / "plain.json"
    run = start_server(tiny_ckpt)
    try:
        assert _bench(run.url, plain, "--save-replay", str(rec)) == 0
    finally:
        assert run.stop() == 0
    spec = dict(algorithm="REPLAY", draft_model=draft, num_steps=2, replay_path=str(rec), replay_miss_rate=0.3)
    runs = _bench_twice(tiny_ckpt, spec, tmp_path, "replay")
    p, s = json.loads(plain.read_text()), json.loads(runs[0].read_text())
    assert [r["text"] for r in p["requests"]] == [r["text"] for r in s["requests"]]
    assert s["speculative"]["algorithm"] == "REPLAY" and s["speculative"]["benchmark_only"] is True
    out = capsys.readouterr().out
    assert "benchmark-only replay draft, miss rate 0.3" in out and "Acceptance at draft position 2:" in out
    prompts = random_prompts(8, 64, 20260724, s["vocab_size"], s["excluded_token_ids"])
    assert len(read_recordings(str(rec))) == 8
    want = [expected_per_position(q.tolist(), 2, 0.3, 0, max_tokens=48) for q in prompts]
    assert [r["accepted_per_position"] for r in s["requests"]] == want
    total = [sum(w[i] for w in want) for i in range(2)]
    assert s["accepted_per_position_usage"] == s["accepted_per_position_metrics"] == total
    assert s["spec_steps_metrics"] == s["event_total"]
    assert s["mean_accepted_length"] == 1 + sum(total) / s["event_total"]
    assert 0 < s["acceptance_per_position"][1] < s["acceptance_per_position"][0] < 1
    rc = main(["bench", "compare", "--baseline", str(runs[0]), "--candidate", str(runs[1])])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "matched the baseline exactly" in out and "benchmark-only REPLAY draft" in out


def test_metrics_are_counted_before_the_step_is_delivered(tiny_ckpt):
    """A client that has seen its last token and then scrapes /metrics sees that step's counts (bench serve compares
    the /metrics delta with the responses' usage, exactly)."""
    import httpx

    run = start_server(tiny_ckpt)
    order = []
    ae = run.server.async_engine
    observe, deliver = ae.metrics.observe_engine, ae._deliver
    ae.metrics.observe_engine = lambda stats: order.append(("observe", stats["steps"])) or observe(stats)
    ae._deliver = lambda outs: order.append(("deliver", ae.engine.num_steps)) or deliver(outs)
    try:
        r = httpx.post(f"{run.url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4})
        assert r.status_code == 200
    finally:
        assert run.stop() == 0
    steps = [s for what, s in order if what == "deliver"]
    assert steps and all(order.index(("observe", s)) < order.index(("deliver", s)) for s in steps), order


def test_simulated_acceptance_through_the_server(tiny_ckpt, tmp_path, capsys):
    """--speculative-simulate-acceptance (benchmark only) through the server: the acceptance is the one set, the
    bench's report and `bench compare` say the run is benchmark-only and its texts are not the model's."""
    draft = make_random_draft("tiny-eagle3", str(tmp_path / "draft"), target=tiny_ckpt, dtype="float32")
    spec = dict(draft_model=draft, num_steps=2, simulate_acceptance=1.0)
    runs = _bench_twice(tiny_ckpt, spec, tmp_path, "sim")
    s = json.loads(runs[0].read_text())
    card = s["speculative"]
    assert card["algorithm"] == "EAGLE3" and card["benchmark_only"] is True and card["simulate_acceptance"] == 1.0
    # every verify accepts both drafts (a request's last step may be cut by max_tokens)
    assert s["acceptance_per_position"][0] > 0.9 and s["mean_accepted_length"] > 2.7
    out = capsys.readouterr().out
    assert "benchmark-only simulated acceptance 1.0" in out
    main(["bench", "compare", "--baseline", str(runs[0]), "--candidate", str(runs[1])])
    assert "its texts are not the model's greedy texts" in capsys.readouterr().out
