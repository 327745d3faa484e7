"""`bench serve` end to end against a fake OpenAI streaming server (a test double in this file), then `bench compare`.

The fake streams deterministic tokens, one or two per event as a speculative decoder with verify width two would, with
token_ids, usage (accepted/rejected draft tokens) and /metrics counters that agree with them.
"""

import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import PlainTextResponse, StreamingResponse  # noqa: E402

from mlaserve.bench.prompts import random_prompts, with_shared_prefix  # noqa: E402
from mlaserve.cli import main  # noqa: E402

VOCAB = 1000


def make_app(token_ids: bool = True, flush: bool = False) -> FastAPI:
    app = FastAPI()
    totals = {"draft": 0, "accepted": 0, "generation": 0, "prompt": 0, "drafts": 0}
    if flush:  # SGLang's cache reset only

        @app.post("/flush_cache")
        def flush_cache():
            return PlainTextResponse("Cache flushed.")

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": "fake-model",
                    "object": "model",
                    "vocab_size": VOCAB,
                    "bos_token_id": 0,
                    "eos_token_id": 1,
                    "speculative": {"algorithm": "EAGLE3", "num_steps": 1, "num_draft_tokens": 2},
                }
            ],
        }

    @app.get("/metrics")
    def metrics():
        lines = []
        for name, key in (
            ("spec_decode_num_draft_tokens", "draft"),
            ("spec_decode_num_accepted_tokens", "accepted"),
            ("generation_tokens", "generation"),
            ("prompt_tokens", "prompt"),
            ("spec_decode_num_drafts", "drafts"),
        ):
            lines += [f"# TYPE mlaserve:{name} counter", f'mlaserve:{name}_total{{model_name="fake"}} {totals[key]}.0']
        # one draft position (K=1): every accepted token was draft token 1
        name = "mlaserve:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [f'{name}{{model_name="fake",position="0"}} {totals["accepted"]}.0']
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        prompt, n = body["prompt"], body["max_tokens"]
        assert body["stream"] and body["return_token_ids"] and body["stream_options"]["include_usage"]
        if any(t in (0, 1) for t in prompt):  # the client must avoid the special ids the card lists
            return PlainTextResponse("special token in prompt", status_code=400)
        toks = [(sum(prompt) * 31 + 7 * i * i) % VOCAB for i in range(n)]
        # the prefill event carries 1 token; each later step 1 + (accepted draft: token parity), capped at n
        sizes, i = [], 0
        while i < n:
            sizes.append(1 if i == 0 else min(1 + toks[i] % 2, n - i))
            i += sizes[-1]
        accepted = sum(k - 1 for k in sizes)
        steps = len(sizes) - 1
        totals.update(
            draft=totals["draft"] + steps,
            drafts=totals["drafts"] + steps,
            accepted=totals["accepted"] + accepted,
            generation=totals["generation"] + n,
            prompt=totals["prompt"] + len(prompt),
        )

        async def events():
            pos = 0
            for k in sizes:
                ids = toks[pos : pos + k]
                pos += k
                choice = {
                    "index": 0,
                    "text": "".join(f" t{t}" for t in ids),
                    "finish_reason": "length" if pos == n else None,
                }
                if token_ids:
                    choice["token_ids"] = ids
                yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"
                await asyncio.sleep(0.001)
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": n,
                "total_tokens": len(prompt) + n,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {
                    "accepted_prediction_tokens": accepted,
                    "rejected_prediction_tokens": steps - accepted,
                    "accepted_prediction_tokens_per_position": [accepted],
                },
            }
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def fake_server(request):
    """Start the fake on a free loopback port in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(**getattr(request, "param", {})), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _serve(url, out, *extra):
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
            "--ignore-eos",
            "--disable-tqdm",
            "--save-result",
            str(out),
            *extra,
        ]
    )


def test_serve_twice_then_compare(fake_server, tmp_path, capsys):
    a, b = tmp_path / "base-1.json", tmp_path / "cand-1.json"
    assert _serve(fake_server, a, "--label", "baseline", "--num-warmups", "2") == 0
    assert _serve(fake_server, b) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Acceptance proxy" in out
    assert "Acceptance at draft position 1:" in out and "Mean accepted length:" in out
    assert "Speculative decoding: EAGLE3 K=1 N=2" in out
    r = json.loads(a.read_text())
    assert r["model"] == "fake-model" and r["vocab_size"] == VOCAB and r["vocab_size_source"] == "server"
    assert r["excluded_token_ids"] == [0, 1]
    assert r["prompts_sha256"] == json.loads(b.read_text())["prompts_sha256"]
    assert r["config"]["seed"] == 20260724 and r["config"]["request_rate"] == "inf" and r["label"] == "baseline"
    assert r["git_commit"] and r["mlaserve_version"] and r["date"]
    assert (r["completed"], r["failed"], r["event_counting"]) == (8, 0, "token_ids")
    assert r["total_output_tokens"] == 8 * 64 and r["total_input_tokens"] == 8 * 64
    # the fake's sizes make every event after the first carry 1 + accepted: the proxy's count is exact here
    assert r["accepted_tokens_proxy"] == r["accepted_tokens_usage"] == r["accepted_tokens_metrics"] > 0
    assert r["accepted_tokens_agree"] is True
    assert r["acceptance_proxy"] == pytest.approx((8 * 64 - 8) / r["event_total"] - 1)
    assert r["warnings"] == []
    # acceptance per draft position: usage and /metrics agree, and with the verify steps give the mean length
    acc, steps = r["accepted_tokens_usage"], r["event_total"]
    assert r["accepted_per_position_usage"] == r["accepted_per_position_metrics"] == [acc]
    assert r["spec_steps_metrics"] == steps
    assert r["acceptance_per_position"] == [acc / steps] and r["mean_accepted_length"] == 1 + acc / steps
    assert r["speculative"]["algorithm"] == "EAGLE3"
    prompts = random_prompts(8, 64, 20260724, VOCAB, exclude=[0, 1])
    for q in r["requests"]:
        assert sum(q["event_vector"]) == q["output_tokens"] == 64 and len(q["output_token_ids"]) == 64
        assert 2 in q["event_vector"] and q["event_vector"][0] == 1
        assert q["text"] == "".join(f" t{t}" for t in q["output_token_ids"])
        assert q["output_token_ids"][0] == (int(prompts[q["index"]].sum()) * 31) % VOCAB
        assert len(q["itl_ms"]) == len(q["event_vector"]) - 1
        assert q["ttft_ms"] <= q["e2el_ms"] and q["tpot_ms"] == pytest.approx((q["e2el_ms"] - q["ttft_ms"]) / 63)
    assert r["median_ttft_ms"] > 0 and r["output_throughput"] > 0 and r["p99_itl_ms"] is not None
    assert main(["bench", "compare", "--baseline", str(a), "--candidate", str(b)]) == 0  # test_compare plots
    assert "matched the baseline exactly" in capsys.readouterr().out


@pytest.mark.parametrize("fake_server", [{"token_ids": False}], indirect=True)
def test_server_without_token_ids(fake_server, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _serve(fake_server, out, "--model", "fake-model") == 0
    r = json.loads(out.read_text())
    assert r["event_counting"] == "text_events" and any("no token_ids" in w for w in r["warnings"])
    q = r["requests"][0]
    assert q["output_token_ids"] is None and set(q["event_vector"]) == {1}
    # T comes from usage, E counts real events: the proxy stays right even when event vectors cannot be
    assert r["total_output_tokens"] == 8 * 64
    assert r["accepted_tokens_proxy"] == r["accepted_tokens_usage"]


def test_failed_requests_are_counted(fake_server, tmp_path, capsys):
    out = tmp_path / "r.json"
    # ids drawn from {0..3} with no exclusions: every prompt holds 0 or 1, which the fake rejects
    assert _serve(fake_server, out, "--exclude-token-ids", "", "--vocab-size", "4") == 1
    r = json.loads(out.read_text())
    assert r["failed"] == 8 and r["completed"] == 0 and "HTTP 400" in r["errors"][0]["error"]


def test_unreachable_server(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _serve(f"http://127.0.0.1:{port}", tmp_path / "r.json") == 2
    assert "pass --model" in capsys.readouterr().out


def test_save_replay_records_the_greedy_outputs(fake_server, tmp_path, capsys):
    from mlaserve.spec.replay import read_recordings

    rec = tmp_path / "replay.jsonl"
    assert _serve(fake_server, tmp_path / "r.json", "--save-replay", str(rec)) == 0
    assert "saved 8 greedy outputs for the benchmark-only REPLAY draft" in capsys.readouterr().out
    r = json.loads((tmp_path / "r.json").read_text())
    recordings = read_recordings(str(rec))
    prompts = random_prompts(8, 64, 20260724, VOCAB, exclude=[0, 1])
    assert {tuple(p.tolist()): q["output_token_ids"] for p, q in zip(prompts, r["requests"])} == recordings
    assert r["replay_recordings"] == {"path": str(rec), "count": 8}
    assert _serve(fake_server, tmp_path / "s.json", "--save-replay", str(rec), "--temperature", "0.5") == 2
    assert "--save-replay records greedy outputs" in capsys.readouterr().out


@pytest.mark.parametrize("fake_server", [{"flush": True}], indirect=True)
def test_reset_prefix_cache_falls_back_to_flush_cache(fake_server, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _serve(fake_server, out, "--reset-prefix-cache") == 0
    assert json.loads(out.read_text())["prefix_cache_reset"] == "/flush_cache"


def test_reset_prefix_cache_refused_is_an_error(fake_server, tmp_path, capsys):
    assert _serve(fake_server, tmp_path / "r.json", "--reset-prefix-cache") == 2
    said = capsys.readouterr().out
    assert "--reset-prefix-cache: the server did not reset its cache (/reset_prefix_cache: HTTP 404" in said
    assert "/flush_cache: HTTP 404" in said and not (tmp_path / "r.json").exists()
    assert _serve(fake_server, tmp_path / "r.json") == 0
    assert json.loads((tmp_path / "r.json").read_text())["prefix_cache_reset"] is None


def test_shared_prefix_prompts(fake_server, tmp_path, capsys):
    a, b = tmp_path / "prefix.json", tmp_path / "none.json"
    assert _serve(fake_server, a, "--random-prefix-len", "16", "--num-warmups", "1") == 0
    assert "Shared prompt prefix (tokens):" in capsys.readouterr().out
    r = json.loads(a.read_text())
    assert r["config"]["prefix_len"] == 16 and r["total_input_tokens"] == 8 * (16 + 64)
    prompts = with_shared_prefix(random_prompts(8, 64, 20260724, VOCAB, exclude=[0, 1]), 16, 20260724, VOCAB, [0, 1])
    for q in r["requests"]:  # the fake's first token is a function of the prompt's sum
        assert q["output_token_ids"][0] == (int(prompts[q["index"]].sum()) * 31) % VOCAB
    assert _serve(fake_server, b) == 0
    assert main(["bench", "compare", "--baseline", str(b), "--candidate", str(a)]) in (0, 1)
    assert "--prefix-len 16 differs" in capsys.readouterr().out
    assert _serve(fake_server, b, "--prefix-len", "-1") == 2
    assert "--prefix-len must be >= 0" in capsys.readouterr().out
