"""TTFT of a burst: B prompts of L tokens added at once (the seed's protocol starts so: 8 prompts of 8,192 tokens,
concurrency 8), on a plain engine and on an EAGLE3 engine (K=1, N=2, simulated acceptance 0 so its texts are the
target's greedy ones) sharing one runner. Per request the time to its first token, and per step what it scheduled
(decode rows, prefill tokens) and how long it took, so a TTFT gap between the two can be put on the steps that make it.

    python benchmarks/burst_ttft.py --preset moonlight-16b-a3b --draft /tmp/m1-dummy-draft   # M1, random in place
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_engine import gpu_busy, kernel_rows, ml_ttft, prompts, sync  # noqa: E402
from benchmarks.bench_util import code_id  # noqa: E402
from mlaserve.config import EngineConfig, ModelConfig, SpecConfig  # noqa: E402
from mlaserve.types import SamplingParams  # noqa: E402


def burst(engine, vocab: int, batch: int, length: int, max_tokens: int, seed: int) -> dict:
    """One burst on `engine`: every request's TTFT (ms from the burst's start) and each step's schedule and time."""
    sched = engine.scheduler
    plans = []  # per schedule() call: (decode rows, prefill tokens, prefill rows)
    real = sched.schedule

    def traced():
        out = real()
        plans.append((len(out.decode), sum(c.num_new for c in out.prefill), len(out.prefill)))
        return out

    sched.schedule = traced
    try:
        ps = prompts(batch, length, vocab, seed=seed)
        sync()
        t0 = time.perf_counter()
        rids = [
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)) for p in ps
        ]
        first: dict[str, float] = {}
        steps = []
        while engine.has_unfinished():
            n, had = len(plans), len(first)
            outs = engine.step()
            t = time.perf_counter()
            for o in outs:
                if o.new_token_ids and o.request_id not in first:
                    first[o.request_id] = (t - t0) * 1e3
            steps.append(dict(t_ms=(t - t0) * 1e3, plans=plans[n:], firsts=len(first) - had))
        sync()
        total = (time.perf_counter() - t0) * 1e3
    finally:
        sched.schedule = real
    ttfts = [first[r] for r in rids]
    return dict(ttft_ms=ttfts, median_ttft_ms=statistics.median(ttfts), total_ms=total, steps=steps)


def prefill_profile(engine, vocab: int, length: int, top: int = 14) -> dict:
    """One request's prefill to its first token's event (max_tokens 2, so a draft extends over the prompt) under
    torch's profiler: the GPU's busy time against the span, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    wall = ml_ttft(engine, length, vocab, reps=1, around=lambda: prof, max_tokens=2)
    rows = kernel_rows(prof)
    busy, span = gpu_busy(prof)
    print(
        f"  one {length}-token prefill: {wall * 1e3:.1f} ms to the first token, GPU busy {busy / 1e3:.1f} ms of a "
        f"{span / 1e3:.1f} ms span; top kernels:"
    )
    for k, ms, c in rows[:top]:
        print(f"    {ms:8.2f} ms {c:5d}x  {k[:90]}")
    return dict(wall_ms=wall * 1e3, busy_ms=busy / 1e3, span_ms=span / 1e3, kernels=[list(r) for r in rows[:40]])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="moonlight-16b-a3b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--draft", required=True, help="an EAGLE3 draft folder (made at random to fit if absent)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2, help="bursts per engine (fresh prompts each); the first untimed")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--profile", action="store_true", help="also one prompt's prefill on each engine, profiled")
    a = ap.parse_args()

    from mlaserve.engine.engine import LLMEngine
    from mlaserve.models.make_random import make_random
    from mlaserve.models.make_random_draft import make_random_draft

    path = make_random(a.preset, "/tmp/cfg-burst", layers=a.layers, dtype="bfloat16", config_only=True)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    if not os.path.isdir(a.draft):
        make_random_draft("kimi-k2.5-eagle3", a.draft, target=path, dtype="bfloat16")
    cfg = EngineConfig(
        model=path,
        load_format="dummy",
        enable_prefix_caching=False,
        max_num_seqs=a.batch,
        warmup=False,
        max_model_len=a.length + a.max_tokens + 64,
        **({"max_num_batched_tokens": a.max_num_batched_tokens} if a.max_num_batched_tokens else {}),
    )
    spec = SpecConfig(draft_model=a.draft, num_steps=1, num_draft_tokens=2, simulate_acceptance=0.0)
    plain = LLMEngine(cfg, reserve_for=spec)
    res = dict(
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        command=" ".join(sys.argv),
        **code_id(),
        runs={},
    )
    for name in ("plain", "eagle3"):
        engine = plain if name == "plain" else LLMEngine(cfg, runner=plain.runner, spec=spec)
        for r in range(a.reps):
            b = burst(engine, vocab, a.batch, a.length, a.max_tokens, seed=100 * r + 7)
        res["runs"][name] = b
        print(f"\n{name}: median TTFT {b['median_ttft_ms']:.1f} ms, all {a.max_tokens} tokens {b['total_ms']:.0f} ms")
        print("  TTFT ms: " + " ".join(f"{x:.0f}" for x in b["ttft_ms"]))
        prev = 0.0
        for i, s in enumerate(b["steps"][:24]):
            plans = " ".join(f"d{d}+p{p}/{n}" for d, p, n in s["plans"])
            print(f"  step {i:3d} {s['t_ms'] - prev:7.1f} ms  {plans:28s} first tokens {s['firsts']}")
            prev = s["t_ms"]
        if a.profile:
            res["runs"][name]["profile"] = prefill_profile(engine, vocab, a.length)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
