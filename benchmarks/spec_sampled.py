"""Sampled requests (temperature > 0) with EAGLE3 against plain sampled decoding: the trained default model with its
trained draft, continuations of the draft's held-out prompts at batch 1 and 8, rounds alternating between the two
engines (each built once). Reports ms per engine step, output tokens/s, the mean accepted length, and the share of
engine steps that verified and drafted on the device (spec_device_steps / steps; the rest are prefills). Needs a GPU.

    python benchmarks/spec_sampled.py [--k 1] [--temperature 0.7] [--rounds 2] [--model DIR --draft DIR]
    python benchmarks/spec_sampled.py --sampler both     # each engine under the race kernel and the reference
    python benchmarks/spec_sampled.py --temperature 0 --k 3 --ngram 2,4   # greedy, with an NGRAM engine beside

--sampler both times every engine with the sampled rows drawn by the race kernel (kernels/race_sample.py) and by the
torch reference it replaced, alternating in one process: the A/B of that change without a second tree.

To compare source trees, run it with each tree first on PYTHONPATH and the model folders given (the trees that
benchmarks/ab_trees.sh exports leave out mlaserve/assets).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mlaserve.layers import sampler
from mlaserve.llm import LLM, default_draft_path, default_model_path
from mlaserve.types import SamplingParams


def timed(llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams) -> dict:
    eng = llm.engine
    torch.cuda.synchronize()
    st, t0 = eng.stats(), time.perf_counter()
    n = 0
    for i in range(0, len(prompts), batch):
        n += sum(len(r.token_ids) for r in llm.generate(prompts[i : i + batch], params, use_tqdm=False))
    torch.cuda.synchronize()
    dt, s2 = time.perf_counter() - t0, eng.stats()
    d = {k: s2.get(k, 0) - st.get(k, 0) for k in ("steps", "spec_steps", "spec_accepted_tokens", "spec_device_steps")}
    return dict(
        seconds=dt,
        steps=d["steps"],
        ms_per_step=1e3 * dt / d["steps"],
        tok_s=n / dt,
        mean_accepted_length=1 + d["spec_accepted_tokens"] / max(d["spec_steps"], 1),  # spec_steps: per request
        device_share=d["spec_device_steps"] / max(d["steps"], 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=1, help="draft steps")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--draft", default=default_draft_path())
    ap.add_argument("--sampler", choices=("race", "reference", "both"), default="race")
    ap.add_argument(
        "--ngram", default=None, metavar="LO,HI", help="also an NGRAM engine (prompt lookup, n-grams of LO..HI tokens)"
    )
    ap.add_argument("--tag", default="", help="a name for the JSON (spec_sampled[_TAG]_k<K>.json)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    with open(os.path.join(a.draft, "eval_prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f][: a.prompts]
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, ignore_eos=True)
    spec = {"algorithm": "EAGLE3", "draft_model": a.draft, "num_steps": a.k}
    engines = {
        "plain": LLM(a.model, max_model_len=1024, num_pages=1024),
        f"eagle3 K={a.k}": LLM(a.model, max_model_len=1024, num_pages=1024, speculative_config=spec),
    }
    if a.ngram:
        lo, hi = (int(x) for x in a.ngram.split(","))
        ng = {"algorithm": "NGRAM", "num_steps": a.k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}
        engines[f"ngram K={a.k}"] = LLM(a.model, max_model_len=1024, num_pages=1024, speculative_config=ng)
    for llm in engines.values():
        llm.generate(prompts[:2], params, use_tqdm=False)
    race = sampler._fused
    samplers = {"race": race, "reference": lambda p, V: False}  # the reference: every row on the torch path
    names = list(samplers) if a.sampler == "both" else [a.sampler]
    rows = []
    for r in range(a.rounds):
        for mode in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            for sname in names if r % 2 == 0 else names[::-1]:
                sampler._fused = samplers[sname]
                for b in (1, 8):
                    t = timed(engines[mode], prompts, b, params)
                    rows.append(dict(mode=mode, sampler=sname, batch=b, round=r, **t))
    sampler._fused = race
    for llm in engines.values():
        llm.close()
    print(
        f"{'mode':<12} {'sampler':<9} {'batch':>5}  ms a step (rounds)     tokens/s (rounds)      accept len  on device"
    )
    for b in (1, 8):
        for mode in engines:
            for sname in names:
                rs = [x for x in rows if x["mode"] == mode and x["batch"] == b and x["sampler"] == sname]
                ms = " / ".join(f"{x['ms_per_step']:.3f}" for x in rs)
                tok = " / ".join(f"{x['tok_s']:.0f}" for x in rs)
                acc, share = rs[-1]["mean_accepted_length"], rs[-1]["device_share"]
                print(f"{mode:<12} {sname:<9} {b:>5}  {ms:<22} {tok:<22} {acc:>10.2f}  {share:.2f}")
    os.makedirs(a.out, exist_ok=True)
    info = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        k=a.k,
        temperature=a.temperature,
        prompts=len(prompts),
        max_tokens=a.max_tokens,
        model=a.model,
        draft=a.draft,
        rows=rows,
    )
    name = f"spec_sampled{'_' + a.tag if a.tag else ''}_k{a.k}.json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
