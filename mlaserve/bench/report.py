"""Provenance, the vLLM-style summary table and the result-file layout shared by `bench serve` and `bench compare`."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path

_PKG = Path(__file__).resolve().parents[1]  # the mlaserve package folder


def _git(*cmd: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_PKG), *cmd], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def mlaserve_version() -> str | None:
    try:
        return importlib.metadata.version("mlaserve")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # a source checkout run with PYTHONPATH: read pyproject.toml beside the package
        import tomllib

        return tomllib.loads((_PKG.parent / "pyproject.toml").read_text())["project"]["version"]
    except (ImportError, OSError, KeyError, ValueError):
        return None


def provenance() -> dict:
    """date (ISO, local time with offset), mlaserve version, git commit of this checkout and whether it is dirty."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "mlaserve_version": mlaserve_version(),
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,
        "hostname": platform.node(),
    }


def dumps_result(result: dict) -> str:
    """Indented JSON, except that each per-request record sits on one line (they hold thousands of numbers)."""
    head = json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=1)
    reqs = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in result.get("requests", []))
    return head[:-2] + ',\n "requests": [\n  ' + reqs + "\n ]\n}\n"


def _fmt(v, nd: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool) or isinstance(v, int) or isinstance(v, str):
        return str(v)
    return f"{v:.{nd}f}"


def format_summary(r: dict) -> str:
    cfg = r["config"]
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(name, v, nd=2):
        lines.append(f"{name:<40}{_fmt(v, nd):>10}")

    def head(title):
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))

    lines.append(f"Model: {r['model']}")
    spec = r.get("speculative")
    if spec:
        what = f"{spec['algorithm']} K={spec['num_steps']} N={spec['num_draft_tokens']}"
        if spec.get("simulate_acceptance") is not None:
            what += f" (benchmark-only simulated acceptance {spec['simulate_acceptance']}: not the model's text)"
        elif spec.get("benchmark_only"):
            what += f" (benchmark-only replay draft, miss rate {spec.get('replay_miss_rate')})"
        lines.append(f"Speculative decoding: {what}")
    row("Successful requests:", r["completed"])
    row("Failed requests:", r["failed"])
    row("Maximum request concurrency:", cfg.get("max_concurrency"))
    row("Request rate (req/s):", cfg.get("request_rate"))
    row("Benchmark duration (s):", r["duration_s"])
    if cfg.get("prefix_len"):
        row("Shared prompt prefix (tokens):", cfg["prefix_len"])
    row("Total input tokens:", r["total_input_tokens"])
    row("Total generated tokens:", r["total_output_tokens"])
    row("Request throughput (req/s):", r["request_throughput"])
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Total token throughput (tok/s):", r["total_token_throughput"])
    for fig, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        head(title)
        for stat in ("mean", "median", "std", "p99"):
            row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {fig.upper()} (ms):", r[f"{stat}_{fig}_ms"])
    head("Events and acceptance")
    row("Event counting:", r["event_counting"])
    row("Event total E:", r["event_total"])
    row("Acceptance proxy (T-R)/E-1:", r["acceptance_proxy"], 8)
    row("Accepted tokens, proxy T-R-E:", r["accepted_tokens_proxy"])
    row("Accepted tokens, usage sum:", r["accepted_tokens_usage"])
    row("Accepted tokens, /metrics delta:", r["accepted_tokens_metrics"])
    row("Draft tokens, /metrics delta:", r["draft_tokens_metrics"])
    row("Usage and /metrics agree:", r["accepted_tokens_agree"])
    row("Verify steps, /metrics delta:", r.get("spec_steps_metrics"))
    row("Mean accepted length:", r.get("mean_accepted_length"), 4)
    for i, a in enumerate(r.get("acceptance_per_position") or []):
        row(f"Acceptance at draft position {i + 1}:", a, 4)
    row("Cached prompt tokens (usage):", r["cached_tokens_usage"])
    lines.append("=" * w)
    for e in r["errors"][:10]:
        lines.append(f"error: request {e['index']}: {e['error']}")
    if len(r["errors"]) > 10:
        lines.append(f"... and {len(r['errors']) - 10} more errors")
    lines += [f"warning: {x}" for x in r["warnings"]]
    return "\n".join(lines)
