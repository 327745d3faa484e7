"""A speculative server (EAGLE3, random draft, K=1 N=2) against a plain one, through `bench serve` and
`bench compare`: identical texts and token ids; the bench's acceptance proxy agrees with the server's exact counts."""

import json

from mlaserve.cli import main
from mlaserve.models.make_random_draft import make_random_draft

from ..server.conftest import assert_idle_no_leak, start_server


def _bench(url, out):
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
        ]
    )


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
