"""The greedy EAGLE3 step as one CUDA graph (engine/spec_graph.py) against the same step's pieces launched one by one,
on one engine in one process, rounds alternating: the trained default model with its trained draft, greedy
continuations of 8 of the draft's held-out prompts, at batch 1 and 8; plain decoding first (its own engine). Reports
ms per engine step, output tokens/s, the mean accepted length, the steps the step graph ran, and how many texts equal
plain decoding's. Needs a GPU (the launches are what the step graph saves the host).

    python benchmarks/spec_step_graph.py [--k 1] [--rounds 3] [--max-tokens 256] [--out DIR]
    PYTHONPATH=$PWD/ab/new python benchmarks/spec_step_graph.py --model mlaserve/assets/pycode-13m \
        --draft mlaserve/assets/pycode-13m-eagle3   # the engine of an ab_trees.sh tree (made without the assets)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mlaserve.llm import LLM, default_draft_path, default_model_path
from mlaserve.types import SamplingParams


def timed(llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams) -> tuple[list[list[int]], dict]:
    """Greedy outputs of `prompts`, `batch` at a time -> (token ids, figures)."""
    eng = llm.engine
    torch.cuda.synchronize()
    st, t0 = eng.stats(), time.perf_counter()
    ids = []
    for i in range(0, len(prompts), batch):
        ids += [r.token_ids for r in llm.generate(prompts[i : i + batch], params, use_tqdm=False)]
    torch.cuda.synchronize()
    dt, s2 = time.perf_counter() - t0, eng.stats()
    steps, verifies = s2["steps"] - st["steps"], s2["spec_steps"] - st["spec_steps"]
    accepted = s2["spec_accepted_tokens"] - st["spec_accepted_tokens"]
    return ids, dict(
        seconds=dt,
        steps=steps,
        ms_per_step=1e3 * dt / steps,
        tok_s=sum(map(len, ids)) / dt,
        mean_accepted_length=1 + accepted / max(verifies, 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=1, help="draft steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--model", default=None, help="the target (default: the shipped default model)")
    ap.add_argument("--draft", default=None, help="its EAGLE3 draft, with eval_prompts.jsonl (default: shipped)")
    a = ap.parse_args()
    draft = a.draft or default_draft_path()
    model = a.model or default_model_path()
    with open(os.path.join(draft, "eval_prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f][: a.prompts]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    rows, plain = [], {}
    llm = LLM(model, max_model_len=1024, num_pages=1024)
    llm.generate(prompts[:1], params, use_tqdm=False)
    for r in range(2):
        for b in (1, 8):
            plain[b], m = timed(llm, prompts, b, params)
            rows.append(dict(mode="plain", batch=b, round=r, **m))
    llm.close()
    del llm
    spec = {"algorithm": "EAGLE3", "draft_model": draft, "num_steps": a.k}
    llm = LLM(model, max_model_len=1024, num_pages=1024, speculative_config=spec)
    eng = llm.engine
    loop = getattr(eng.loop, "loop", eng.loop)  # the SpecLoop an OverlapLoop wraps
    graphs = eng.spec_step_graphs
    if graphs is None:
        raise SystemExit("no step graphs were captured (a GPU, one rank, EAGLE3 without simulated acceptance)")
    llm.generate(prompts[:1], params, use_tqdm=False)
    for r in range(a.rounds):
        for mode in ("launches", "graph") if r % 2 == 0 else ("graph", "launches"):
            loop.step_graphs = graphs if mode == "graph" else None
            for b in (1, 8):
                ran = eng.runner.graphs.static_runs["spec_step"]
                ids, m = timed(llm, prompts, b, params)
                m["graph_steps"] = eng.runner.graphs.static_runs["spec_step"] - ran
                m["equal_to_plain"] = sum(x == y for x, y in zip(ids, plain[b]))
                rows.append(dict(mode=f"eagle3 K={a.k} {mode}", batch=b, round=r, **m))
    loop.step_graphs = graphs
    llm.close()
    print(f"{'mode':<22} {'batch':>5}  ms a step (each round)      tokens/s (each round)     accept len  = plain")
    for b in (1, 8):
        for mode in ("plain", f"eagle3 K={a.k} launches", f"eagle3 K={a.k} graph"):
            rs = [x for x in rows if x["mode"] == mode and x["batch"] == b]
            ms = " / ".join(f"{x['ms_per_step']:.3f}" for x in rs)
            tok = " / ".join(f"{x['tok_s']:.0f}" for x in rs)
            same = f"{rs[-1]['equal_to_plain']}/{len(prompts)}" if "equal_to_plain" in rs[-1] else ""
            print(f"{mode:<22} {b:>5}  {ms:<27} {tok:<25} {rs[-1]['mean_accepted_length']:>10.2f}  {same}")
    os.makedirs(a.out, exist_ok=True)
    info = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        k=a.k,
        prompts=len(prompts),
        max_tokens=a.max_tokens,
        draft=draft,
        rows=rows,
    )
    with open(os.path.join(a.out, f"spec_step_graph_k{a.k}.json"), "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
