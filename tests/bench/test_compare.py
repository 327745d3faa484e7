"""`bench compare`: figures, % changes, and the identity check's exit code on synthetic results."""

import copy
import json

import pytest

from mlaserve.bench.compare import figure_rows
from mlaserve.bench.metrics import summarize_run
from mlaserve.cli import main


def _result(scale: float = 1.0) -> dict:
    """A small bench result; `scale` stretches every time (so figures change but outputs do not)."""
    reqs = []
    for i in range(3):
        events = [1, 2, 1, 2] if i != 1 else [1, 1, 2, 2]
        times = [scale * (10.0 + i + 5 * k) for k in range(len(events))]
        reqs.append(
            {
                "index": i,
                "prompt_len": 4,
                "success": True,
                "error": None,
                "text": f"request {i} says hi",
                "output_token_ids": list(range(6)),
                "event_vector": events,
                "event_counting": "token_ids",
                "ttft_ms": times[0],
                "itl_ms": [b - a for a, b in zip(times, times[1:])],
                "e2el_ms": times[-1],
                "tpot_ms": (times[-1] - times[0]) / 5,
                "output_tokens": 6,
                "streamed_tokens": 6,
                "prompt_tokens": 4,
                "cached_tokens": 0,
                "accepted_tokens": 2,
                "rejected_tokens": 1,
                "accepted_per_position": [2],
                "finish_reason": "length",
                "start_s": 0.0,
                "end_s": times[-1] / 1000.0,
            }
        )
    cfg = {
        "num_prompts": 3,
        "max_concurrency": 3,
        "request_rate": "inf",
        "input_len": 4,
        "output_len": 6,
        "seed": 20260724,
        "num_warmups": 0,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return {
        "schema": "mlaserve.bench.serve/1",
        "model": "m",
        "config": cfg,
        "prompts_sha256": "abc",
        "event_counting": "token_ids",
        **summarize_run(reqs),
        "requests": reqs,
    }


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return str(p)


def _compare(tmp_path, base, cand, *extra):
    b = [_write(tmp_path, f"base-{i}.json", d) for i, d in enumerate(base)]
    c = [_write(tmp_path, f"cand-{i}.json", d) for i, d in enumerate(cand)]
    return main(["bench", "compare", "--baseline", *b, "--candidate", *c, *extra])


def test_identical_runs_exit_0(tmp_path, capsys):
    out_json = tmp_path / "cmp.json"
    rc = _compare(
        tmp_path,
        [_result(1.0), _result(1.02), _result(0.99)],
        [_result(0.9), _result(0.91)],
        "--plot",
        str(tmp_path / "cmp.png"),
        "--save-result",
        str(out_json),
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "matched the baseline exactly" in out and "Every run completed 3/3 requests" in out
    assert "Median TTFT moved from " in out and ", TPOT from " in out
    assert (tmp_path / "cmp.png").stat().st_size > 1000
    saved = json.loads(out_json.read_text())
    assert saved["identical"] is True and saved["problems"] == []
    ttft = next(r for r in saved["figures"] if r["figure"] == "TTFT")
    assert ttft["baseline"]["min"] < ttft["baseline"]["max"] and ttft["change_pct"] > 0  # candidate is faster


@pytest.mark.parametrize(
    "what", ["text", "event_vector", "output_token_ids", "event_total", "proxy", "failed", "per_position"]
)
def test_any_difference_exits_1(tmp_path, capsys, what):
    bad = _result(0.9)
    r1 = bad["requests"][1]
    if what == "text":
        r1["text"] = "request 1 says ho"
    elif what == "event_vector":
        r1["event_vector"] = [1, 2, 1, 2]
    elif what == "output_token_ids":
        r1["output_token_ids"] = [0, 1, 2, 3, 4, 9]
    elif what == "event_total":
        bad["event_total"] += 1
    elif what == "proxy":
        bad["acceptance_proxy"] += 1e-9
    elif what == "per_position":
        bad["accepted_per_position_usage"] = [5]
    else:
        r1.update(success=False, error="HTTP 500: boom")
        bad.update(summarize_run(bad["requests"]))
    rc = _compare(tmp_path, [_result(), _result()], [_result(0.9), bad])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "OUTPUTS DIFFER" in out and "cand-1.json" in out
    if what in ("text", "event_vector", "output_token_ids"):
        assert "request 1:" in out
    if what == "failed":
        assert "completed 2/3 requests" in out and "HTTP 500" in out
    if what == "per_position":
        assert "accepted tokens per draft position [5] differ" in out


def test_difference_in_a_baseline_run_is_caught(tmp_path, capsys):
    other = copy.deepcopy(_result())
    other["requests"][0]["text"] = "changed"
    assert _compare(tmp_path, [_result(), other], [_result()]) == 1
    assert "base-1.json vs" in capsys.readouterr().out


def test_figure_rows_median_of_medians():
    base = [
        (
            "a",
            {
                "median_ttft_ms": v,
                "median_tpot_ms": 1.0,
                "median_itl_ms": 1.0,
                "median_e2el_ms": 1.0,
                "output_throughput": t,
            },
        )
        for v, t in ((10.0, 100.0), (30.0, 90.0), (20.0, 110.0))
    ]
    cand = [
        (
            "b",
            {
                "median_ttft_ms": 15.0,
                "median_tpot_ms": 1.0,
                "median_itl_ms": 1.0,
                "median_e2el_ms": None,
                "output_throughput": 120.0,
            },
        )
    ]
    rows = {r["figure"]: r for r in figure_rows(base, cand)}
    assert rows["TTFT"]["baseline"] == {"runs": [10.0, 30.0, 20.0], "median": 20.0, "min": 10.0, "max": 30.0}
    assert rows["TTFT"]["change_pct"] == pytest.approx(25.0)
    assert rows["output throughput"]["change_pct"] == pytest.approx(20.0)
    assert rows["E2EL"]["change_pct"] is None
    # which way is better, the raw change in the figure's unit, and the verdict against the baseline's range
    assert rows["TTFT"]["better"] == "lower" and rows["output throughput"]["better"] == "higher"
    assert rows["TTFT"]["change"] == pytest.approx(-5.0) and rows["TTFT"]["verdict"] == "within range"
    assert rows["output throughput"]["change"] == pytest.approx(20.0)
    assert rows["output throughput"]["verdict"] == "better"
    assert rows["TPOT"]["verdict"] == "within range" and rows["E2EL"]["verdict"] == "n/a"


def test_unreadable_file_exits_2(tmp_path, capsys):
    assert main(["bench", "compare", "--baseline", str(tmp_path / "nope.json"), "--candidate", "x.json"]) == 2
