"""`mlaserve bench compare`: medians, ranges and % change of baseline vs candidate bench results, and the identity
check (text, event vectors, event total, acceptance proxy) across every run; exits 1 when any of it differs."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from .metrics import pct_improvement
from .report import provenance

SCHEMA = "mlaserve.bench.compare/1"
# (name, result key, unit, higher is better): the compare quotes each run's median
FIGURES = (
    ("TTFT", "median_ttft_ms", "ms", False),
    ("TPOT", "median_tpot_ms", "ms", False),
    ("ITL", "median_itl_ms", "ms", False),
    ("E2EL", "median_e2el_ms", "ms", False),
    ("output throughput", "output_throughput", "tok/s", True),
)
# config fields that must match for the runs to be one protocol (a difference is warned about, not failed)
PROTOCOL = (
    "num_prompts",
    "max_concurrency",
    "request_rate",
    "input_len",
    "prefix_len",
    "output_len",
    "seed",
    "num_warmups",
    "temperature",
    "ignore_eos",
)

ADDED_LATER = {"prefix_len": 0}  # protocol fields newer than some results: what those ran with


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", nargs="+", required=True, metavar="A.json", help="baseline result files")
    p.add_argument("--candidate", nargs="+", required=True, metavar="B.json", help="candidate result files")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot per-run TTFT, TPOT and throughput")
    p.add_argument("--save-result", default=None, metavar="FILE.json", help="write the comparison as JSON")
    p.add_argument("--max-diffs", type=int, default=20, help="differences named per run (default: %(default)s)")


def load_runs(paths: list[str]) -> list[tuple[str, dict]]:
    runs = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read bench result {path}: {e}") from e
        if not isinstance(data, dict) or "requests" not in data or "completed" not in data:
            raise ValueError(f"{path} is not a `mlaserve bench serve` result (no 'requests'/'completed')")
        runs.append((path, data))
    return runs


def _side(runs: list[tuple[str, dict]], key: str) -> dict:
    vals = [d.get(key) for _, d in runs]
    known = [v for v in vals if v is not None]
    if not known:
        return {"runs": vals, "median": None, "min": None, "max": None}
    return {"runs": vals, "median": statistics.median(known), "min": min(known), "max": max(known)}


def verdict(b: dict, c: dict, higher: bool) -> str:
    """'better' / 'worse' when the candidate's median moved the good / bad way and lies outside the baseline's
    run-to-run range; 'within range' when it lies inside it (or with one run a side, when equal); 'n/a'."""
    if b["median"] is None or c["median"] is None:
        return "n/a"
    if b["min"] <= c["median"] <= b["max"]:
        return "within range"
    return "better" if (c["median"] > b["median"]) == higher else "worse"


def figure_rows(base: list[tuple[str, dict]], cand: list[tuple[str, dict]]) -> list[dict]:
    """Per figure: median over runs of each run's median, the min-max range per side, the raw change (candidate -
    baseline, in the figure's unit), % improvement (positive = better), which way is better, and a verdict."""
    rows = []
    for name, key, unit, higher in FIGURES:
        b, c = _side(base, key), _side(cand, key)
        known = b["median"] is not None and c["median"] is not None
        rows.append(
            {
                "figure": name,
                "key": key,
                "unit": unit,
                "better": "higher" if higher else "lower",
                "baseline": b,
                "candidate": c,
                "change": c["median"] - b["median"] if known else None,
                "change_pct": pct_improvement(b["median"], c["median"], higher),
                "verdict": verdict(b, c, higher),
            }
        )
    return rows


def _first_diff(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _request_diffs(ref: dict, other: dict) -> list[str]:
    out = []
    if ref["text"] != other["text"]:
        i = _first_diff(ref["text"], other["text"])
        out.append(
            f"generated text differs from char {i} (lengths {len(ref['text'])} vs {len(other['text'])}): "
            f"{ref['text'][i : i + 24]!r} vs {other['text'][i : i + 24]!r}"
        )
    if ref["event_vector"] != other["event_vector"]:
        a, b = ref["event_vector"], other["event_vector"]
        i = _first_diff(a, b)
        out.append(f"event vector differs at event {i} ({a[i : i + 6]} vs {b[i : i + 6]}; {len(a)} vs {len(b)} events)")
    ra, rb = ref.get("output_token_ids"), other.get("output_token_ids")
    if ra is not None and rb is not None and ra != rb:
        out.append(f"output token ids differ from token {_first_diff(ra, rb)}")
    return out


def identity_problems(base: list[tuple[str, dict]], cand: list[tuple[str, dict]], max_diffs: int = 20) -> list[str]:
    """Everything that breaks the identity check, each naming the run (and request); [] when all identical."""
    problems = []
    runs = base + cand
    ref_path, ref = base[0]
    for path, d in runs:
        n = d.get("config", {}).get("num_prompts", len(d["requests"]))
        if d["failed"] or d["completed"] != n:
            errs = "; ".join(f"request {e['index']}: {e['error']}" for e in d.get("errors", [])[:3])
            problems.append(f"{path}: completed {d['completed']}/{n} requests" + (f" ({errs})" if errs else ""))
    ref_reqs = {r["index"]: r for r in ref["requests"]}
    for path, d in runs[1:]:
        if d.get("prompts_sha256") != ref.get("prompts_sha256"):
            problems.append(f"{path}: prompts differ from {ref_path} (seed, lengths, vocab or excluded ids differ)")
        reqs = {r["index"]: r for r in d["requests"]}
        diffs = []
        for idx in sorted(set(ref_reqs) | set(reqs)):
            if idx not in ref_reqs or idx not in reqs:
                diffs.append(f"request {idx} is missing from {ref_path if idx not in ref_reqs else path}")
            elif ref_reqs[idx]["success"] and reqs[idx]["success"]:
                diffs += [f"request {idx}: {x}" for x in _request_diffs(ref_reqs[idx], reqs[idx])]
        problems += [f"{path} vs {ref_path}: {x}" for x in diffs[:max_diffs]]
        if len(diffs) > max_diffs:
            problems.append(f"{path} vs {ref_path}: ... and {len(diffs) - max_diffs} more differences")
        for key, what in (("event_total", "event total"), ("acceptance_proxy", "acceptance proxy")):
            if d.get(key) != ref.get(key):
                problems.append(f"{path}: {what} {d.get(key)} differs from {ref_path}'s {ref.get(key)}")
        a, b = ref.get("accepted_per_position_usage"), d.get("accepted_per_position_usage")
        if a is not None and b is not None and a != b:  # both speculative: the same drafts accepted at each position
            problems.append(f"{path}: accepted tokens per draft position {b} differ from {ref_path}'s {a}")
    return problems


def config_warnings(runs: list[tuple[str, dict]]) -> list[str]:
    ref_path, ref = runs[0]
    out = []
    for path, d in runs[1:]:
        for k in PROTOCOL:
            a, b = (r.get("config", {}).get(k, ADDED_LATER.get(k)) for r in (ref, d))
            if a != b:
                out.append(f"{path}: --{k.replace('_', '-')} {b} differs from {ref_path}'s {a}")
        if d.get("speculative") != ref.get("speculative"):
            out.append(f"{path}: speculative decoding {d.get('speculative')} differs from {ref_path}'s")
    for path, d in runs:
        if d.get("event_counting") not in (None, "token_ids"):
            out.append(f"{path}: server sent no token_ids; event vectors count 1 token per event")
        spec = d.get("speculative") or {}
        if spec.get("simulate_acceptance") is not None:
            out.append(
                f"{path}: ran with the benchmark-only simulated acceptance {spec['simulate_acceptance']}: its speed is "
                "at a set acceptance rate and its texts are not the model's greedy texts"
            )
        elif spec.get("benchmark_only"):
            out.append(
                f"{path}: ran the benchmark-only REPLAY draft (miss rate {spec.get('replay_miss_rate')}): "
                "its speed is at a set acceptance rate, not a trained draft's"
            )
    return out


def _num(v, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:.3f}" + (f" {unit}" if unit else "")


def format_table(rows: list[dict], nb: int, nc: int) -> str:
    hdr = (
        f"{'figure (median)':<26}{'better':>8}{f'baseline (n={nb})':>14}{'baseline range':>24}"
        f"{f'candidate (n={nc})':>16}{'candidate range':>24}{'change':>12}{'improvement':>13}{'verdict':>15}"
    )
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        b, c = r["baseline"], r["candidate"]
        ch = "n/a" if r["change_pct"] is None else f"{r['change_pct']:+.3f}%"
        raw = "n/a" if r["change"] is None else f"{r['change']:+.3f}"
        lines.append(
            f"{r['figure'] + ' (' + r['unit'] + ')':<26}{r['better']:>8}{_num(b['median']):>14}"
            f"{_num(b['min']) + ' - ' + _num(b['max']):>24}{_num(c['median']):>16}"
            f"{_num(c['min']) + ' - ' + _num(c['max']):>24}{raw:>12}{ch:>13}{r['verdict']:>15}"
        )
    return "\n".join(lines)


def format_prose(rows: list[dict]) -> str:
    """The seed's sentences: 'Median TTFT moved from X to Y ms (+Z%), ...' and the TPOT/throughput ranges."""
    by = {r["figure"]: r for r in rows}
    moved = []
    for name in ("TTFT", "TPOT", "E2EL", "output throughput"):
        r = by[name]
        ch = "n/a" if r["change_pct"] is None else f"{r['change_pct']:+.3f}%"
        b, c = _num(r["baseline"]["median"]), _num(r["candidate"]["median"], r["unit"])
        moved.append(f"{name}{' moved' if not moved else ''} from {b} to {c} ({ch})")
    t, o = by["TPOT"], by["output throughput"]
    return (
        f"Median {', '.join(moved[:-1])}, and {moved[-1]}.\n"
        f"Candidate TPOT ranged from {_num(t['candidate']['min'])} to {_num(t['candidate']['max'], 'ms')} and "
        f"output throughput from {_num(o['candidate']['min'])} to {_num(o['candidate']['max'], 'tok/s')}; "
        f"the corresponding baseline ranges were {_num(t['baseline']['min'])} to {_num(t['baseline']['max'], 'ms')}"
        f" and {_num(o['baseline']['min'])} to {_num(o['baseline']['max'], 'tok/s')}."
    )


def cli_main(args) -> int:
    try:
        base, cand = load_runs(args.baseline), load_runs(args.candidate)
    except ValueError as e:
        print(f"bench compare: {e}")
        return 2
    rows = figure_rows(base, cand)
    problems = identity_problems(base, cand, args.max_diffs)
    warnings = config_warnings(base + cand)
    print(format_table(rows, len(base), len(cand)))
    print()
    print(format_prose(rows))
    ref = base[0][1]
    if not problems:
        n = ref["completed"]
        proxy = ref["acceptance_proxy"]
        proxy_s = "n/a" if proxy is None else f"{proxy * 100:.6f}%"
        print(
            f"Every run completed {n}/{n} requests. Generated text, per-request response-event vectors, the "
            f"{ref['event_total']:,}-event total, and the {proxy_s} acceptance proxy matched the baseline exactly "
            f"({len(base)} baseline, {len(cand)} candidate runs)."
        )
    else:
        print(f"OUTPUTS DIFFER or runs failed ({len(problems)} problems): the changes above are not a valid speedup.")
        for p in problems:
            print(f"  {p}")
    for w in warnings:
        print(f"warning: {w}")
    if args.plot:
        from .plot import plot_runs

        plot_runs(base, cand, args.plot)
        print(f"saved {args.plot}")
    if args.save_result:
        out = {
            "schema": SCHEMA,
            **provenance(),
            "baseline": [p for p, _ in base],
            "candidate": [p for p, _ in cand],
            "figures": rows,
            "identical": not problems,
            "problems": problems,
            "warnings": warnings,
            "event_total": ref.get("event_total"),
            "acceptance_proxy": ref.get("acceptance_proxy"),
        }
        Path(args.save_result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_result).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if not problems else 1
