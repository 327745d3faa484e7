"""The seed's benchmark protocol, scaled down, against the real server: `bench serve` twice (8 prompts, concurrency 8,
64 in / 64 out, seed 20260724, 0 warmups, greedy), then `bench compare` reports them identical and exits 0; a
candidate served from different weights makes it exit non-zero."""

import json

from mlaserve.cli import main
from mlaserve.models.make_random import make_random

from .conftest import assert_idle_no_leak, start_server


def _bench(url, out, label, *extra):
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
            "64",
            "--seed",
            "20260724",
            "--num-warmups",
            "0",
            "--temperature",
            "0",
            "--ignore-eos",
            "--disable-tqdm",
            "--label",
            label,
            "--save-result",
            str(out),
            *extra,
        ]
    )


def test_bench_twice_identical_then_other_weights_differ(server, tmp_path, tmp_path_factory, capsys):
    base, cand = tmp_path / "base-1.json", tmp_path / "cand-1.json"
    assert _bench(server.url, base, "baseline") == 0
    assert _bench(server.url, cand, "candidate", "--reset-prefix-cache") == 0  # cold, as the baseline's first run
    assert json.loads(cand.read_text())["prefix_cache_reset"] == "/reset_prefix_cache"
    r = json.loads(base.read_text())
    # /v1/models told the bench the vocabulary and the special ids to keep out of the prompts
    assert r["vocab_size"] == 512 and r["vocab_size_source"] == "server"
    assert set(r["excluded_token_ids"]) >= {256, 257}
    assert (r["completed"], r["failed"], r["event_counting"], r["warnings"]) == (8, 0, "token_ids", [])
    assert r["total_output_tokens"] == 8 * 64 and r["total_input_tokens"] == 8 * 64
    assert all(q["event_vector"] == [1] * 64 for q in r["requests"]), "one event per step, one token per step"
    assert r["event_total"] == 8 * 63 and r["acceptance_proxy"] == 0.0
    assert r["accepted_tokens_agree"] is True and r["server_metrics"]["delta"]["generation_tokens"] == 8 * 64
    capsys.readouterr()
    assert main(["bench", "compare", "--baseline", str(base), "--candidate", str(cand)]) == 0
    assert "matched the baseline exactly" in capsys.readouterr().out
    assert_idle_no_leak(server)

    other = start_server(
        make_random("tiny", str(tmp_path_factory.mktemp("tiny-seed1")), seed=1, dtype="float32", progress=False)
    )
    try:
        wrong = tmp_path / "cand-other-weights.json"
        assert _bench(other.url, wrong, "other weights") == 0
    finally:
        assert other.stop() == 0
    assert json.loads(wrong.read_text())["prompts_sha256"] == r["prompts_sha256"]
    capsys.readouterr()
    assert main(["bench", "compare", "--baseline", str(base), "--candidate", str(wrong)]) != 0
    assert "OUTPUTS DIFFER" in capsys.readouterr().out
