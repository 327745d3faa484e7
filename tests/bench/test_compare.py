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


def _drop(d, idx):
    d["requests"] = [r for r in d["requests"] if r["index"] != idx]
    d.update(summarize_run(d["requests"]))


def _reindex(d, old, new):
    next(r for r in d["requests"] if r["index"] == old)["index"] = new


# each difference the identity check claims: how to make it in one candidate run, and every problem it must name
DIFFS = {
    "text": (lambda d: d["requests"][1].update(text="request 1 says ho"), ["request 1: generated text differs"]),
    "event_vector": (
        lambda d: d["requests"][1].update(event_vector=[1, 2, 1, 2]),
        ["request 1: event vector differs at event 1"],
    ),
    "output_token_ids": (
        lambda d: d["requests"][1].update(output_token_ids=[0, 1, 2, 3, 4, 9]),
        ["request 1: output token ids differ from token 5"],
    ),
    "event_total": (
        lambda d: d.update(event_total=d["event_total"] + 1),
        ["event total 10 differs from base-0.json's 9"],
    ),
    "proxy": (lambda d: d.update(acceptance_proxy=d["acceptance_proxy"] + 1e-9), [": acceptance proxy 0."]),
    "failed": (  # a failed request's text and events are not compared: only the failure is named
        lambda d: (
            d["requests"][1].update(success=False, error="HTTP 500: boom", text="", event_vector=[]),
            d.update(summarize_run(d["requests"])),
        ),
        # the failed request's events and accepted drafts leave the totals too
        ["completed 2/3 requests (request 1: HTTP 500: boom)", "event total 6 differs", "position [4] differ"],
    ),
    "per_position": (
        lambda d: d.update(accepted_per_position_usage=[5]),
        ["accepted tokens per draft position [5] differ"],
    ),
    "prompts": (lambda d: d.update(prompts_sha256="abd"), ["prompts differ from base-0.json"]),
    "missing_request": (
        lambda d: _drop(d, 2),
        ["completed 2/3 requests", "request 2 is missing from cand-1.json", "event total 6 differs", "[4] differ"],
    ),
    "other_request": (  # the same number of requests, but not the same set
        lambda d: _reindex(d, 2, 7),
        ["request 2 is missing from cand-1.json", "request 7 is missing from base-0.json"],
    ),
}


@pytest.mark.parametrize("what", list(DIFFS))
def test_any_difference_exits_1_and_names_itself(tmp_path, capsys, what):
    bad = _result(0.9)
    make, names = DIFFS[what]
    make(bad)
    out_json = tmp_path / "cmp.json"
    rc = _compare(tmp_path, [_result(), _result()], [_result(0.9), bad], "--save-result", str(out_json))
    out = capsys.readouterr().out.replace(f"{tmp_path}/", "")
    assert rc == 1, out
    problems = [p.replace(f"{tmp_path}/", "") for p in json.loads(out_json.read_text())["problems"]]
    assert f"OUTPUTS DIFFER or runs failed ({len(problems)} problems)" in out
    assert all(p.startswith("cand-1.json") for p in problems), problems  # only the run that differs, named
    assert len(problems) == len(names), problems  # each difference once, and nothing else reported
    for name in names:
        assert any(name in p for p in problems), (name, problems)
    assert not json.loads(out_json.read_text())["identical"]


def test_max_diffs_caps_the_differences_named(tmp_path, capsys):
    bad = _result()
    for r in bad["requests"]:
        r["text"] += "!"
    assert _compare(tmp_path, [_result()], [bad], "--max-diffs", "2") == 1
    out = capsys.readouterr().out
    assert "request 0: generated text" in out and "request 1: generated text" in out
    assert "request 2: generated text" not in out and "... and 1 more differences" in out


def _warnings(tmp_path, capsys) -> list[str]:
    out = capsys.readouterr().out.replace(f"{tmp_path}/", "")
    return [x for x in out.splitlines() if x.startswith("warning: ")]


@pytest.mark.parametrize(
    "key,value,flag",
    [
        ("num_prompts", 4, "--num-prompts 4"),
        ("max_concurrency", 8, "--max-concurrency 8"),
        ("request_rate", 2.0, "--request-rate 2.0"),
        ("input_len", 5, "--input-len 5"),
        ("output_len", 7, "--output-len 7"),
        ("seed", 1, "--seed 1"),
        ("num_warmups", 2, "--num-warmups 2"),
        ("temperature", 0.5, "--temperature 0.5"),
        ("ignore_eos", False, "--ignore-eos False"),
    ],
)
def test_protocol_differences_are_warned_about_by_name(tmp_path, capsys, key, value, flag):
    """A protocol difference is a warning naming the flag and both values; it does not fail the compare on its own
    (outputs that match are still the same outputs), so the exit code stays 0."""
    other = _result()
    other["config"][key] = value
    # 4 prompts asked for and 3 completed is also a failed run
    assert _compare(tmp_path, [_result(), _result()], [other]) == (1 if key == "num_prompts" else 0)
    was = _result()["config"][key]
    assert _warnings(tmp_path, capsys) == [f"warning: cand-0.json: {flag} differs from base-0.json's {was}"]


def test_a_protocol_field_newer_than_a_result_reads_as_its_default(tmp_path, capsys):
    """Results written before --prefix-len ran without a prefix: 0 matches them, 16 is a difference by name."""
    new = _result()
    new["config"]["prefix_len"] = 0
    assert _compare(tmp_path, [_result()], [new]) == 0
    assert _warnings(tmp_path, capsys) == []
    new["config"]["prefix_len"] = 16
    assert _compare(tmp_path, [_result()], [new]) == 0
    assert _warnings(tmp_path, capsys) == ["warning: cand-0.json: --prefix-len 16 differs from base-0.json's 0"]


def test_run_level_warnings(tmp_path, capsys):
    spec = {"algorithm": "REPLAY", "benchmark_only": True, "replay_miss_rate": 0.3}
    other = _result()
    other.update(speculative=spec, event_counting="events")
    assert _compare(tmp_path, [_result()], [other]) == 0
    warnings = _warnings(tmp_path, capsys)
    assert warnings == [
        f"warning: cand-0.json: speculative decoding {spec} differs from base-0.json's",
        "warning: cand-0.json: server sent no token_ids; event vectors count 1 token per event",
        "warning: cand-0.json: ran the benchmark-only REPLAY draft (miss rate 0.3): its speed is at a set acceptance "
        "rate, not a trained draft's",
    ], warnings


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


def _problems(base, cand, **kw):
    from mlaserve.bench.compare import identity_problems

    return identity_problems([("a.json", base)], [("b.json", cand)], **kw)


def test_difference_messages_quote_the_first_difference():
    a, b = _result(), _result()
    a["requests"][0]["text"] = "x" * 10 + "abcdefghijklmnopqrstuvwxyz0123"
    b["requests"][0]["text"] = "x" * 10 + "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123"
    a["requests"][2]["event_vector"] = [1, 2, 3, 4, 5, 6, 7, 8]
    b["requests"][2]["event_vector"] = [1, 9, 9, 9, 9, 9, 9, 9, 9]
    assert _problems(a, b) == [
        "b.json vs a.json: request 0: generated text differs from char 10 (lengths 40 vs 40): "
        "'abcdefghijklmnopqrstuvwx' vs 'ABCDEFGHIJKLMNOPQRSTUVWX'",  # 24 characters from the first difference
        "b.json vs a.json: request 2: event vector differs at event 1 ([2, 3, 4, 5, 6, 7] vs [9, 9, 9, 9, 9, 9]; "
        "8 vs 9 events)",
    ]


@pytest.mark.parametrize("n,more", [(20, False), (21, True)])
def test_twenty_differences_named_by_default(n, more):
    a, b = _result(), _result()
    for r in (a, b):
        r["requests"] = [dict(r["requests"][0], index=i) for i in range(n)]
        r["config"]["num_prompts"] = r["completed"] = n
    for r in b["requests"]:
        r["text"] += "!"
    got = _problems(a, b)
    assert len(got) == 20 + more and got[-1].endswith("... and 1 more differences") == more


def test_a_failed_run_names_its_first_three_errors():
    b = _result()
    b.update(completed=0, failed=3, errors=[{"index": i, "error": f"e{i}"} for i in range(4)])
    assert _problems(_result(), b)[0] == "b.json: completed 0/3 requests (request 0: e0; request 1: e1; request 2: e2)"
    del b["errors"]
    assert _problems(_result(), b)[0] == "b.json: completed 0/3 requests"


def test_results_without_a_config_compare_by_their_requests(tmp_path, capsys):
    """Older results lack 'config': the request count stands in for num_prompts, and no protocol warning is made up."""
    a, b = _result(), _result()
    del a["config"], b["config"]
    assert _problems(a, b) == []
    assert _compare(tmp_path, [a], [b]) == 0 and _warnings(tmp_path, capsys) == []


def test_the_same_speculative_config_is_not_warned_about(tmp_path, capsys):
    a, b = _result(), _result()
    a["speculative"] = b["speculative"] = {"algorithm": "EAGLE3", "num_steps": 2}
    assert _compare(tmp_path, [a], [b]) == 0 and _warnings(tmp_path, capsys) == []


@pytest.mark.parametrize(
    "data,why",
    [
        ("{not json", "cannot read bench result"),
        ([1, 2], "is not a `mlaserve bench serve` result (no 'requests'/'completed')"),
        ({"requests": []}, "is not a `mlaserve bench serve` result"),
        ({"completed": 0}, "is not a `mlaserve bench serve` result"),
    ],
)
def test_a_file_that_is_no_result_exits_2_naming_it(tmp_path, capsys, data, why):
    bad = tmp_path / "bad.json"
    bad.write_text(data if isinstance(data, str) else json.dumps(data))
    good = _write(tmp_path, "good.json", _result())
    assert main(["bench", "compare", "--baseline", good, "--candidate", str(bad)]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"bench compare: {bad}") or out.startswith(f"bench compare: cannot read bench result {bad}")
    assert why in out, out
