"""Benchmark maths shared by `bench serve` and `bench compare`, exactly as docs/benchmarking.md defines each figure.

Times are milliseconds unless a name ends in `_s`. Empty samples give None (JSON null), never NaN.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

# figure -> per-request field it is summarised from (ITL pools every request's gaps)
LATENCY_FIGURES = ("ttft", "tpot", "itl", "e2el")


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std (population, like vLLM) and p99 (linear interpolation) of a sample."""
    if len(values) == 0:
        return {"mean": None, "median": None, "std": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
        "p99": float(np.percentile(a, 99)),
    }


def tpot_ms(e2el_ms: float, ttft_ms: float, output_tokens: int) -> float | None:
    """(E2EL - TTFT) / (output_tokens - 1); undefined (None) for fewer than two output tokens."""
    if output_tokens < 2:
        return None
    return (e2el_ms - ttft_ms) / (output_tokens - 1)


def itls_ms(token_event_times_ms: Sequence[float]) -> list[float]:
    """Gaps between consecutive token-carrying events."""
    return [b - a for a, b in zip(token_event_times_ms[:-1], token_event_times_ms[1:])]


def event_total(event_vectors: Sequence[Sequence[int]]) -> int:
    """E: over all requests, the number of token-carrying events after each request's first."""
    return sum(max(len(v) - 1, 0) for v in event_vectors)


def acceptance_proxy(total_output_tokens: int, num_requests: int, events: int) -> float | None:
    """(T - R) / E - 1: the mean number of draft tokens accepted per step (None when E is 0)."""
    if events <= 0:
        return None
    return (total_output_tokens - num_requests) / events - 1


def acceptance_by_position(per_position: Sequence[int] | None, steps: int | None) -> dict:
    """Per draft position i: the share of verify steps that accepted draft token i + 1; and the mean accepted length
    1 + accepted / steps (vLLM's). Nones when unknown."""
    if not per_position or not steps:
        return {"acceptance_per_position": None, "mean_accepted_length": None}
    return {
        "acceptance_per_position": [a / steps for a in per_position],
        "mean_accepted_length": 1 + sum(per_position) / steps,
    }


def pct_improvement(baseline: float, candidate: float, higher_is_better: bool) -> float | None:
    """% change, positive when the candidate is better (lower times, higher throughput)."""
    if baseline is None or candidate is None or baseline == 0:
        return None
    if higher_is_better:
        return (candidate - baseline) / baseline * 100.0
    return (baseline - candidate) / baseline * 100.0


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None:  # blank, '# HELP', '# TYPE'
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def counters_by_label(text: str, suffix: str, label: str) -> dict[str, float]:
    """{label value: sample value} of a labelled counter, found by name suffix as `counter` finds it (summed over
    its other labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None or not (m.group(1) == suffix or m.group(1).endswith(":" + suffix)):
            continue
        lm = re.search(label + r'="([^"]*)"', m.group(2) or "")
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if lm is not None:
            out[lm.group(1)] = out.get(lm.group(1), 0.0) + value
    return out


def counter(samples: dict[str, float] | None, suffix: str) -> float | None:
    """A counter by name suffix, so `mlaserve:`, `vllm:` and `sglang:` prefixes all match (summed)."""
    if samples is None:
        return None
    hits = [v for k, v in samples.items() if k == suffix or k.endswith(":" + suffix)]
    return sum(hits) if hits else None


def _sum_or_none(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def sum_lists(lists: Sequence[Sequence[int] | None]) -> list[int] | None:
    """Element-wise sum of the lists given (None when none is)."""
    known = [v for v in lists if v is not None]
    if not known:
        return None
    out = [0] * max(len(v) for v in known)
    for v in known:
        for i, x in enumerate(v):
            out[i] += x
    return out


def summarize_run(requests: Sequence[dict]) -> dict:
    """Run-level figures from per-request records (the `requests` list of the result JSON).

    Failed requests are counted and their errors kept, but they contribute to no figure.
    """
    ok = [r for r in requests if r["success"]]
    out: dict = {
        "completed": len(ok),
        "failed": len(requests) - len(ok),
        "errors": [{"index": r["index"], "error": r["error"]} for r in requests if not r["success"]],
    }
    # output throughput = all output tokens / (last completion - first send)
    first_send = min((r["start_s"] for r in requests), default=0.0)
    last_done = max((r["end_s"] for r in ok), default=first_send)
    duration = last_done - first_send
    t_out = sum(r["output_tokens"] for r in ok)
    t_in = sum(r["prompt_tokens"] if r["prompt_tokens"] is not None else r["prompt_len"] for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    out.update(
        {
            "duration_s": duration,
            "total_input_tokens": t_in,
            "total_output_tokens": t_out,
            "request_throughput": per_s(len(ok)),
            "output_throughput": per_s(t_out),
            "total_token_throughput": per_s(t_in + t_out),
        }
    )
    samples = {
        "ttft": [r["ttft_ms"] for r in ok],
        "tpot": [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None],
        "itl": [x for r in ok for x in r["itl_ms"]],
        "e2el": [r["e2el_ms"] for r in ok],
    }
    for fig in LATENCY_FIGURES:
        for k, v in stats(samples[fig]).items():
            out[f"{k}_{fig}_ms"] = v
    events = event_total([r["event_vector"] for r in ok])
    out["event_total"] = events
    out["acceptance_proxy"] = acceptance_proxy(t_out, len(ok), events)
    # what the proxy implies was accepted: every event after the first carries 1 + accepted tokens
    out["accepted_tokens_proxy"] = t_out - len(ok) - events if ok else None
    out["accepted_tokens_usage"] = _sum_or_none([r["accepted_tokens"] for r in ok])
    out["rejected_tokens_usage"] = _sum_or_none([r["rejected_tokens"] for r in ok])
    out["cached_tokens_usage"] = _sum_or_none([r["cached_tokens"] for r in ok])
    out["accepted_per_position_usage"] = sum_lists([r.get("accepted_per_position") for r in ok])
    return out
