"""Where a step of the default model goes, host against GPU: plain decoding and greedy EAGLE3 (its trained draft)
at batch 1, through the engine's loop (ms a step), the same loop under cProfile (the host's functions by their own
time and by cumulative time), and the step's CUDA graph replayed back to back (the GPU's time alone). The gap
between the loop and the replay is what the host and the work between two replays (input copies, event records)
add to a step. Needs a GPU.

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
    prof = cProfile.Profile()
    prof.enable()
    ms_prof = run()
    prof.disable()
    print(f"{name}, batch 1: {ms:.3f} ms a step through the loop, {ms_prof:.3f} under cProfile")
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        print(s.getvalue())
    return {"ms_per_step": ms, "ms_per_step_cprofile": ms_prof}


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
        print(f"{name}: loop {r['ms_per_step']:.3f} ms a step, its graph back to back {r['graph_replay_ms']:.3f} ms")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"default_host_profile_k{a.k}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
