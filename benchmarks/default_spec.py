"""EAGLE3 on the trained default model, against plain decoding in the same process: greedy continuations of the
draft's held-out prompts (its eval_prompts.jsonl) at batch 1 and 8, K = 1..3 draft steps. Reports output tokens/s,
the mean accepted length, the acceptance per draft position, and whether each text equals plain decoding's.

    python benchmarks/default_spec.py [--draft DIR] [--batches 1,8] [--ks 1,2,3] [--max-tokens 256] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback

import torch

from mlaserve.llm import LLM, default_draft_path, default_model_path
from mlaserve.types import SamplingParams


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy outputs of `prompts`, `batch` at a time (each group submitted together); -> (ids, seconds)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm
    out, t = [], 0.0
    for i in range(0, len(prompts), batch):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t += time.perf_counter() - t0
        out += [r.token_ids for r in res]
    return out, t


def spec_rows(a, prompts, batches, k, plain) -> list[dict]:
    rows = []
    spec = {"algorithm": "EAGLE3", "draft_model": a.draft, "num_steps": k}
    llm = LLM(default_model_path(), max_model_len=1024, speculative_config=spec, num_pages=1024)
    for b in batches:
        before = llm.engine.stats()
        ids, s = run(llm, prompts, b, a.max_tokens)
        st = llm.engine.stats()
        steps = st["spec_steps"] - before["spec_steps"]
        acc = [x - y for x, y in zip(st["spec_accepted_per_position"], before["spec_accepted_per_position"])]
        rows.append(
            dict(
                mode=f"eagle3 K={k}",
                batch=b,
                k=k,
                tok_s=sum(map(len, ids)) / s,
                seconds=s,
                verify_steps=steps,
                # engine steps, and those launched while the one before was in flight / verified on the device
                engine_steps=st["steps"] - before["steps"],
                overlapped_steps=st["overlapped_steps"] - before["overlapped_steps"],
                device_steps=st["spec_device_steps"] - before["spec_device_steps"],
                ms_per_step=1000 * s / max(1, st["steps"] - before["steps"]),
                acceptance_per_position=[x / max(steps, 1) for x in acc],
                mean_accepted_length=1 + sum(acc) / max(steps, 1),
                identical_to_plain=sum(x == y for x, y in zip(ids, plain[b])),
                texts=len(ids),
            )
        )
    if a.profile:
        profile(llm, prompts[0], os.path.join(a.out, f"default_spec_k{k}_trace.json"))
    llm.close()
    del llm
    gc.collect()
    return rows


def profile(llm: LLM, prompt: list[int], trace: str) -> None:
    """One request of 64 greedy tokens at batch 1 under torch.profiler: the host's and the GPU's busiest ops, and
    the GPU's busy time against the wall time (a host-bound step leaves the GPU idle between launches)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with torch_profile(activities=acts) as prof:
        llm.generate([prompt], params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25))
    if torch.cuda.is_available():
        print(ka.table(sort_by="self_device_time_total", row_limit=15))
        busy = sum(e.self_device_time_total for e in ka) / 1e6
        print(f"GPU busy {busy * 1e3:.1f} ms of {wall * 1e3:.1f} ms wall ({busy / wall:.0%})")
    os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
    prof.export_chrome_trace(trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=default_draft_path())
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts (a multiple of each batch)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--profile", action="store_true", help="profile one batch-1 request per K (torch.profiler)")
    a = ap.parse_args()
    with open(os.path.join(a.draft, "eval_prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f][: a.prompts]
    batches, ks = [int(b) for b in a.batches.split(",")], [int(k) for k in a.ks.split(",")]
    rows, plain = [], {}
    llm = LLM(default_model_path(), max_model_len=1024, num_pages=1024)
    for b in batches:
        ids, s = run(llm, prompts, b, a.max_tokens)
        plain[b] = ids
        rows.append(dict(mode="plain", batch=b, k=0, tok_s=sum(map(len, ids)) / s, seconds=s))
    llm.close()
    for k in ks:
        try:
            rows += spec_rows(a, prompts, batches, k, plain)
        except Exception:  # one K failing still reports the others
            traceback.print_exc()
    base = {r["batch"]: r["tok_s"] for r in rows if r["mode"] == "plain"}
    print(f"{'mode':<12} {'batch':>5} {'tok/s':>9} {'x plain':>8} {'accept len':>10}  per position   identical")
    for r in rows:
        acc = " ".join(f"{x:.2f}" for x in r.get("acceptance_per_position", []))
        same = f"{r['identical_to_plain']}/{r['texts']}" if "texts" in r else ""
        print(
            f"{r['mode']:<12} {r['batch']:>5} {r['tok_s']:>9.0f} {r['tok_s'] / base[r['batch']]:>8.2f} "
            f"{r.get('mean_accepted_length', 1.0):>10.2f}  {acc:<14} {same}"
        )
    os.makedirs(a.out, exist_ok=True)
    info = dict(
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        prompts=len(prompts),
        max_tokens=a.max_tokens,
        draft=a.draft,
        rows=rows,
    )
    with open(os.path.join(a.out, "default_spec.json"), "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
