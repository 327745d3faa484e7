"""Where a step of the default model goes, host against GPU: plain decoding and greedy EAGLE3 (its trained draft)
at batch 1, through the engine's loop (ms a step), the same loop under cProfile (the host's functions by their own
time and by cumulative time), and the step's CUDA graph replayed back to back (the GPU's time alone). The gap
between the loop and the replay is what the host and the work between two replays (input copies, event records)
add to a step, plus each request's own start and end (its prefill, the steps before the loop overlaps), spread over
its steps. So the loop is also timed at two output lengths (marginal): the difference over the difference in steps
is what one more step costs in steady state, the rest a request's start and end; beside it the host's time a step
in the main functions of the loop (TIMED), Event.synchronize being its wait on a step's read back (near 0: the
host sets the pace). Needs a GPU.

    PYTHONPATH=$PWD python benchmarks/default_host_profile.py [--k 1] [--top 28] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks.*
from benchmarks.bench_util import back_to_back_ms  # noqa: E402
from mlaserve.llm import LLM, default_draft_path, default_model_path  # noqa: E402
from mlaserve.types import SamplingParams  # noqa: E402


def loop(llm: LLM, prompts: list[list[int]], name: str, top: int) -> dict:
    """ms a step through the loop, then the same under cProfile (its top functions printed)."""
    eng, params = llm.engine, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)

    def run() -> float:
        steps = eng.stats()["steps"]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for p in prompts:
            llm.generate([p], params, use_tqdm=False)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t) / (eng.stats()["steps"] - steps)

    ms = run()
    marg = marginal(llm, prompts)
    prof = cProfile.Profile()
    prof.enable()
    ms_prof = run()
    prof.disable()
    print(
        f"{name}, batch 1: {ms:.3f} ms a step through the loop, {ms_prof:.3f} under cProfile; one more step "
        f"{marg['ms_per_step']:.3f} ms, of which the host waited on the read back {marg['wait_ms_per_step']:.3f}; "
        f"each request's start and end {marg['ms_per_request']:.2f} ms"
    )
    for k, v in marg["host_ms_per_step_in"].items():
        print(f"    {v:7.4f} ms a step in {k}")
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        print(s.getvalue())
    return {"ms_per_step": ms, "ms_per_step_cprofile": ms_prof, "marginal": marg}


# Host functions timed inclusively by marginal() (a wrapper each, ~1 us): which of them the steady-state step
# spends its host time in, without cProfile's per-call cost. Nested ones count in their callers too.
TIMED = (
    ("mlaserve.engine.engine", "LLMEngine", "step"),
    ("mlaserve.engine.loop", "Loop", "launch_next"),
    ("mlaserve.engine.loop", "Loop", "process"),
    ("mlaserve.engine.loop", "Loop", "sample"),
    ("mlaserve.engine.spec_loop", "SpecLoop", "launch_next"),
    ("mlaserve.engine.spec_loop", "SpecLoop", "process"),
    ("mlaserve.engine.spec_loop", "SpecLoop", "next_verify"),
    ("mlaserve.engine.spec_loop", "QueuedRows", "__init__"),
    ("mlaserve.engine.spec_graph", "SpecStepGraphs", "run"),
    ("mlaserve.engine.scheduler", "Scheduler", "schedule_decode"),
    ("mlaserve.engine.scheduler", "Scheduler", "schedule_verify"),
    ("mlaserve.engine.postprocess", "Postprocessor", "sampled"),
    ("mlaserve.engine.postprocess", "Postprocessor", "append"),
    ("mlaserve.engine.cuda_graph", "GraphRunner", "run"),
    ("mlaserve.engine.cuda_graph", "GraphRunner", "fill"),
    ("mlaserve.spec.draft_graph", "DraftGraphs", "fill_step"),
    ("torch.cuda", "CUDAGraph", "replay"),
    ("torch.cuda", "Event", "record"),
    ("torch.cuda", "Event", "synchronize"),
)


def marginal(llm: LLM, prompts: list[list[int]], short: int = 128, long: int = 448, rounds: int = 3) -> dict:
    """One more step in steady state: (time, steps, host time in each TIMED function) at `long` output tokens
    minus the same at `short`, per step, from the round whose step time is the median (each round runs both lengths
    over every prompt, one request at a time). Event.synchronize is the host's wait on a step's read back."""
    import importlib

    eng = llm.engine
    spent: dict[str, float] = {}
    saved = []

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    for mod, cls, attr in TIMED:
        owner = getattr(importlib.import_module(mod), cls)
        fn = owner.__dict__.get(attr)
        if fn is not None:  # defined on this class (not only inherited)
            saved.append((owner, attr, fn))
            setattr(owner, attr, timed(f"{cls}.{attr}", fn))

    def one(n: int) -> tuple[float, int, dict]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        steps = eng.stats()["steps"]
        spent.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for p in prompts:
            llm.generate([p], params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t, eng.stats()["steps"] - steps, dict(spent)

    try:
        diffs = []
        for _ in range(rounds):
            (t0, n0, s0), (t1, n1, s1) = one(short), one(long)
            per = {k: 1e3 * (s1[k] - s0.get(k, 0.0)) / (n1 - n0) for k in s1}
            ms = 1e3 * (t1 - t0) / (n1 - n0)
            diffs.append((ms, per, (1e3 * t0 - n0 * ms) / len(prompts)))  # a request's own start and end
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    med = sorted(range(rounds), key=lambda i: diffs[i][0])[rounds // 2]
    ms, per, fixed = diffs[med]
    return {
        "ms_per_step": ms,
        "ms_per_request": fixed,
        "wait_ms_per_step": per.get("Event.synchronize", 0.0),
        "host_ms_per_step_in": dict(sorted(per.items(), key=lambda kv: -kv[1])),
        "rounds_ms_per_step": [d[0] for d in diffs],
        "tokens": [short, long],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=1, help="draft steps")
    ap.add_argument("--top", type=int, default=28, help="functions printed by each cProfile ordering")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    draft, model = default_draft_path(), default_model_path()
    with open(os.path.join(draft, "eval_prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f][:8]
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "k": a.k}
    llm = LLM(model, max_model_len=1024, num_pages=1024)
    res["plain"] = loop(llm, prompts, "plain", a.top)
    decode_graph = llm.engine.runner.graphs.graphs[("decode", 1)].graph
    res["plain"]["graph_replay_ms"] = back_to_back_ms(decode_graph.replay, reps=200)
    llm.close()
    del llm
    spec = {"algorithm": "EAGLE3", "draft_model": draft, "num_steps": a.k}
    llm = LLM(model, max_model_len=1024, num_pages=1024, speculative_config=spec)
    res["eagle3"] = loop(llm, prompts, f"EAGLE3 K={a.k}", a.top)
    res["eagle3"]["graph_replay_ms"] = back_to_back_ms(llm.engine.spec_step_graphs.graphs[1].replay, reps=200)
    llm.close()
    for name in ("plain", "eagle3"):
        r = res[name]
        print(
            f"{name}: loop {r['ms_per_step']:.3f} ms a step ({r['marginal']['ms_per_step']:.3f} one more step), "
            f"its graph back to back {r['graph_replay_ms']:.3f} ms"
        )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"default_host_profile_k{a.k}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
