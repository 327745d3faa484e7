"""A step that mixes decode rows with a new prompt's prefill chunk: one eager forward over both against the decode
rows' graph followed by the chunk's prefill graph (two forwards, the weights read twice, no eager launches; what the
engine runs for chunks up to runner.MIXED_SPLIT_MAX_TOKENS). Wall time per step with the GPU synchronised after it,
and the GPU's time alone (its launches queued behind a sleep kernel), M1 shapes with weights made in place. Then a
workload that admits requests while others decode (--requests prompts of --prompt-len tokens, output lengths drawn
from 32 to 256, all added at once to an engine of --decode's largest batch): its time and output tokens/s, one
forward against two (the limit set to 0, then its default).

    python benchmarks/mixed_step.py --decode 8,32 --prefill 16,512,2048,4096,8192 --ctx 1024 --requests 128

--cached N puts the chunk after N cached tokens (a prefix hit's suffix): the split then runs the decode graph and
the context graph, or for a suffix of at most suffix.SUFFIX_MAX_TOKENS tokens the suffix graph (engine/suffix.py),
both timed ("split" and "suffix").
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

from benchmarks.bench_util import code_id, sleep_cycles  # noqa: E402
from mlaserve.attention.base import SeqChunk  # noqa: E402
from mlaserve.config import EngineConfig  # noqa: E402


def timed(fn, reps: int, hold_cycles: int) -> tuple[float, float]:
    """-> (median wall ms of fn() with the GPU synchronised after it; median GPU ms of fn's work alone: its
    launches queued behind a sleep kernel of hold_cycles, timed from the sleep's end to the last kernel's)."""
    walls, gpus = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(hold_cycles)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        gpus.append(a.elapsed_time(b))
    return statistics.median(walls[1:]), statistics.median(gpus[1:])  # the first warms the shapes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="moonlight-16b-a3b")
    ap.add_argument("--decode", default="1,8,32")
    ap.add_argument("--prefill", default="16,128,512,2048,8192")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--cached", type=int, default=0, help="tokens cached before the chunk (a prefix hit)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--requests", type=int, default=0, help="the workload's requests (0: no workload)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()

    from mlaserve.engine import runner as runner_mod
    from mlaserve.engine.engine import LLMEngine
    from mlaserve.models.make_random import make_random
    from mlaserve.types import SamplingParams

    limit = runner_mod.MIXED_SPLIT_MAX_TOKENS

    decs, pres = [int(x) for x in a.decode.split(",")], [int(x) for x in a.prefill.split(",")]
    path = make_random(a.preset, "/tmp/cfg-mixed", dtype="bfloat16", config_only=True)
    cfg = EngineConfig(
        model=path,
        load_format="dummy",
        enable_prefix_caching=False,
        max_num_seqs=max(decs),
        warmup=False,
        max_model_len=max(a.ctx + 64, a.cached + max(pres) + 64, 16384 if a.cached else 0),  # context buckets
        prefill_graph_max_context=max(16384, a.cached + max(pres)),
    )
    engine = LLMEngine(cfg)
    r = engine.runner
    ps = cfg.page_size
    nxt = [1]  # the next free page (the engine is idle: every page is free to write)

    def pages(n_tokens: int) -> list[int]:
        k = -(-n_tokens // ps)
        out = list(range(nxt[0], nxt[0] + k))
        nxt[0] += k
        return out

    hold = sleep_cycles(250.0)  # longer than any variant's host time
    g = torch.Generator().manual_seed(0)
    rows = []
    print(
        f"{'decode rows':>11s} {'prefill':>8s} | {'mixed wall':>10s} {'GPU':>7s} | {'split wall':>10s} {'GPU':>7s}"
        + (f" | {'suffix wall':>11s} {'GPU':>7s}" if a.cached else "")
    )
    for B in decs:
        nxt[0] = 1
        decode = [SeqChunk([5], a.ctx, pages(a.ctx + 1), "last") for _ in range(B)]
        base = nxt[0]
        for T in pres:
            nxt[0] = base
            ids = torch.randint(1000, 50000, (T,), generator=g).tolist()
            prefill = [SeqChunk(ids, a.cached, pages(a.cached + T), "last")]  # the cached rows: whatever they hold
            runner_mod.MIXED_SPLIT_MAX_TOKENS = 0  # one forward
            mixed = timed(lambda: r.execute(decode, prefill), a.reps, hold)
            runner_mod.MIXED_SPLIT_MAX_TOKENS = limit
            split = timed(lambda: r.execute(decode, prefill), a.reps, hold)  # the context (or prefill) graph
            key = r.graphs.key_for([], prefill) if r.graphs is not None else None
            row = dict(decode=B, prefill=T, ctx=a.ctx, cached=a.cached, prefill_graph=key is not None)
            row.update(mixed_wall_ms=mixed[0], mixed_gpu_ms=mixed[1], split_wall_ms=split[0], split_gpu_ms=split[1])
            line = f"{B:11d} {T:8d} | {mixed[0]:10.2f} {mixed[1]:7.2f} | {split[0]:10.2f} {split[1]:7.2f}"
            if a.cached:
                sfx = timed(lambda: r.execute(decode, prefill, suffix=True), a.reps, hold)
                sk = r.split_keys(decode, prefill, True)
                row.update(suffix_wall_ms=sfx[0], suffix_gpu_ms=sfx[1], suffix_key=str(sk and sk[1]))
                line += f" | {sfx[0]:11.2f} {sfx[1]:7.2f}  ({sk and sk[1]})"
            rows.append(row)
            print(line + ("" if key is not None else "  (no prefill graph: eager)"))
    work = []
    for rnd in range(2 if a.requests else 0):  # rounds: one forward, two, one, two
        for lim in (0, limit):
            runner_mod.MIXED_SPLIT_MAX_TOKENS = lim
            rng = torch.Generator().manual_seed(rnd)
            lens = torch.randint(32, 257, (a.requests,), generator=rng).tolist()
            ps_ = [torch.randint(1000, 50000, (a.prompt_len,), generator=rng).tolist() for _ in lens]
            steps0 = engine.num_steps
            torch.cuda.synchronize()
            t = time.perf_counter()
            for p, n in zip(ps_, lens):
                engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            w = dict(split_limit=lim, seconds=dt, output_tokens=sum(lens), tok_s=sum(lens) / dt)
            w["steps"] = engine.num_steps - steps0
            work.append(w)
            print(f"workload, limit {lim}: {dt:.2f} s, {w['tok_s']:.0f} output tok/s, {w['steps']} steps")
    runner_mod.MIXED_SPLIT_MAX_TOKENS = limit
    res = dict(gpu=torch.cuda.get_device_name(), command=" ".join(sys.argv), **code_id(), rows=rows, workload=work)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "mixed_step.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
