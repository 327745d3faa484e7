"""NGRAM speculative decoding (prompt lookup, spec/ngram.py) against plain greedy decoding on the trained default
model: continuations of the default draft's held-out prompts at batch 1 and 8, rounds alternating between the
engines (each built once). Four NGRAM cases: no prediction (the prompt and output alone), the same on an engine
that overlaps no step with the host (disable_overlap_schedule), each request predicting its exact plain reply
(OpenAI's Predicted Outputs at their best: an unchanged file), and the reply with one token in EDIT replaced (an
edited file). Reports ms per engine step, output tokens/s, x plain and the mean accepted length;
greedy outputs are checked equal to plain's at the same batch ("same"; in bf16 a verify row is reduced in another
order than a decode row, so a near-tie can differ: the --deterministic-inference mode's subject).

    PYTHONPATH=$PWD python benchmarks/ngram_speed.py [--k 3] [--ngram 2,4] [--rounds 2] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from mlaserve.llm import LLM, default_draft_path, default_model_path
from mlaserve.types import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(llm: LLM, prompts, batch: int, params: list[SamplingParams]) -> tuple[dict, list[list[int]]]:
    """Every run starts with the prefix cache empty: a prefix hit changes a bf16 prefill's reduction order, and with
    it the texts compared."""
    eng = llm.engine
    assert llm.reset_prefix_cache()
    _sync()
    st, t0 = eng.stats(), time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += [r.token_ids for r in llm.generate(prompts[i : i + batch], params[i : i + batch], use_tqdm=False)]
    _sync()
    dt, s2 = time.perf_counter() - t0, eng.stats()
    d = {k: s2.get(k, 0) - st.get(k, 0) for k in ("steps", "spec_steps", "spec_accepted_tokens", "overlapped_steps")}
    n = sum(map(len, outs))
    return dict(
        seconds=dt,
        steps=d["steps"],
        overlapped_steps=d["overlapped_steps"],
        ms_per_step=1e3 * dt / d["steps"],
        tok_s=n / dt,
        mean_accepted_length=1 + d["spec_accepted_tokens"] / max(d["spec_steps"], 1),
    ), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=3, help="draft tokens a step")
    ap.add_argument("--ngram", default="2,4", metavar="LO,HI")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--edit", type=int, default=20, help="the edited prediction: one token in EDIT replaced")
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--prompts-from", default=default_draft_path(), help="a folder with eval_prompts.jsonl")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    with open(os.path.join(a.prompts_from, "eval_prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f][: a.prompts]
    lo, hi = (int(x) for x in a.ngram.split(","))
    ng = {"algorithm": "NGRAM", "num_steps": a.k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    kw = dict(max_model_len=1024, num_pages=1024)
    engines = {"plain": LLM(a.model, **kw), f"ngram K={a.k}": LLM(a.model, speculative_config=ng, **kw)}
    # the same NGRAM engine with no step overlapped with the host: what the overlap buys
    engines["ngram serial"] = LLM(a.model, speculative_config=ng, disable_overlap_schedule=True, **kw)
    base = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    V = engines["plain"].engine.model_config.vocab_size
    plain, rng = {}, random.Random(0)  # batch -> plain greedy outputs at that batch (bf16 rows depend on it)
    for b in (1, 8):
        plain[b] = timed(engines["plain"], prompts, b, [base] * len(prompts))[1]

    def predicting(outs):
        return [SamplingParams(**{**base.__dict__, "prediction": o}) for o in outs]

    ngram = f"ngram K={a.k}"
    cases = {  # name -> (engine, batch -> each request's params)
        "plain": ("plain", {b: [base] * len(prompts) for b in plain}),
        "ngram": (ngram, {b: [base] * len(prompts) for b in plain}),
        "ngram, not overlapped": ("ngram serial", {b: [base] * len(prompts) for b in plain}),
        "ngram, exact prediction": (ngram, {b: predicting(o) for b, o in plain.items()}),
        f"ngram, 1/{a.edit} edited": (
            ngram,
            {
                b: predicting([[t if rng.randrange(a.edit) else (t + 1) % V for t in x] for x in o])
                for b, o in plain.items()
            },
        ),
    }
    for llm in engines.values():
        llm.generate(prompts[:2], base, use_tqdm=False)
    rows = []
    for r in range(a.rounds):
        for name in list(cases) if r % 2 == 0 else list(cases)[::-1]:
            eng, params = cases[name]
            for b in (1, 8):
                t, outs = timed(engines[eng], prompts, b, params[b])
                rows.append(dict(case=name, batch=b, round=r, same_as_plain=outs == plain[b], **t))
    for llm in engines.values():
        llm.close()
    print(f"{'case':<28} {'batch':>5}  ms a step (rounds)   tokens/s (rounds)   x plain  accept len  same")
    for b in (1, 8):
        p = [x["tok_s"] for x in rows if x["case"] == "plain" and x["batch"] == b]
        for name in cases:
            rs = [x for x in rows if x["case"] == name and x["batch"] == b]
            ms = " / ".join(f"{x['ms_per_step']:.3f}" for x in rs)
            tok = " / ".join(f"{x['tok_s']:.0f}" for x in rs)
            ratio = sum(x["tok_s"] for x in rs) / sum(p)
            same = all(x["same_as_plain"] for x in rs)
            print(f"{name:<28} {b:>5}  {ms:<20} {tok:<19} {ratio:7.2f}  {rs[-1]['mean_accepted_length']:10.2f}  {same}")
    os.makedirs(a.out, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    info = dict(gpu=gpu, torch=torch.__version__, k=a.k, ngram=[lo, hi], edit=a.edit)
    info.update(prompts=len(prompts), max_tokens=a.max_tokens, model=a.model, rows=rows)
    with open(os.path.join(a.out, f"ngram_speed_k{a.k}.json"), "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
