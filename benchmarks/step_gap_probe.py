"""Where do the ~30 us between two batch-1 decode graph replays go (TPOT 1.83 ms against replay 1.80 ms)?

Builds the engine on the M1 checkpoint, runs a steady greedy decode batch, and times the same graph under loops
that add the step's pieces one at a time, with the host always ahead of the GPU (nothing waits until the end):
  replay            the graph back to back
  +argmax           and the greedy arg-max after it
  +d2h              and the token's copy to pinned memory with its event
  +d2d              and the next step's ids copied from those tokens
  +fill             and the host's input copies (GraphRunner._fill on the real chunks)
  +fill, wait N-1   the same, the host waiting on the step before's event after launching each (as the engine does)
  engine            LLMEngine.step() itself (TPOT), with the host's time split into launch and wait
and, in the engine loop, the GPU's own gap between graphs from events recorded around each replay.
    python benchmarks/step_gap_probe.py --model /tmp/m1 --make moonlight-16b-a3b [--batches 1,8] [--json F]
Written against main d4271bb (session 15), before decode graphs took the arg-max themselves: on later code the
"replay" rows already include it, and the "G2" rows capture it a second time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_util import code_id  # noqa: E402
from mlaserve.config import EngineConfig  # noqa: E402
from mlaserve.types import SamplingParams  # noqa: E402


def timed(fn, reps):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def probe_batch(engine, B, a, V):
    """One batch size's row (see the module docstring)."""
    from mlaserve.layers.sampler import greedy_tokens

    gr = engine.runner.graphs
    last = {}
    orig_run = gr.run
    events = []

    def run(key, d, p, toks=None, _orig=orig_run):
        last.update(key=key, d=d, p=p, toks=toks)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = _orig(key, d, p, toks)
        e1.record()
        events.append((e0, e1))
        return out

    g_state = torch.Generator().manual_seed(B)
    for _ in range(B):
        ids = torch.randint(0, V, (a.ctx,), generator=g_state).tolist()
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=4 * a.reps + 64, ignore_eos=True))
    for _ in range(8):
        engine.step()
    # the engine loop: TPOT, host launch vs wait, GPU gap between graphs (events around each run())
    gr.run = run
    from mlaserve.engine import loop as eng_mod

    waits = []
    orig_read = eng_mod.Launched.read

    def read(self, _orig=orig_read):
        t = time.perf_counter()
        r = _orig(self)
        waits.append(time.perf_counter() - t)
        return r

    eng_mod.Launched.read = read
    torch.cuda.synchronize()
    events.clear()
    t = time.perf_counter()
    for _ in range(a.reps):
        engine.step()
    torch.cuda.synchronize()
    tpot = (time.perf_counter() - t) / a.reps * 1e6
    eng_mod.Launched.read = orig_read
    gr.run = orig_run
    # run() spans: its fill + copies + replay; gap = next span's start - this span's end (argmax, d2h between)
    spans = [e0.elapsed_time(e1) * 1e3 for e0, e1 in events[2:]]
    gaps = [events[i][1].elapsed_time(events[i + 1][0]) * 1e3 for i in range(2, len(events) - 1)]
    wait_us = statistics.median(waits[2:]) * 1e6
    key, d, tok = last["key"], last["d"], last["toks"]
    g = gr.graphs[key]
    n = len(d)
    src = tok if tok is not None else torch.zeros(n, dtype=torch.int64, device="cuda")

    def rep():
        g.graph.replay()

    def rep_argmax():
        g.graph.replay()
        greedy_tokens(g.logits[:n])

    def rep_d2h():
        g.graph.replay()
        t_ = greedy_tokens(g.logits[:n])
        torch.empty(t_.shape, dtype=t_.dtype, pin_memory=True).copy_(t_, non_blocking=True)
        torch.cuda.Event().record()

    state = {"tok": src}

    def rep_d2d():
        gr.input_ids[:n].copy_(state["tok"])
        g.graph.replay()
        state["tok"] = t_ = greedy_tokens(g.logits[:n])
        torch.empty(t_.shape, dtype=t_.dtype, pin_memory=True).copy_(t_, non_blocking=True)
        torch.cuda.Event().record()

    def rep_fill():
        gr._fill(key, g, d, n)
        rep_d2d()

    pend = []

    def rep_fill_wait():
        rep_fill()
        ev = torch.cuda.Event()
        ev.record()
        pend.append(ev)
        if len(pend) > 1:
            pend.pop(0).synchronize()

    row = {}
    # alternatives: the arg-max inside the graph, writing the next step's ids (no id copy); the token's trip back
    # as a copy, or written to pinned memory by a kernel; the three input copies as one (timing stand-in)
    from mlaserve.kernels.argmax import argmax_rows

    G2 = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        for _ in range(2):
            lg, _ = gr._forward(g.batch)
            argmax_rows(lg[:n], out=gr.input_ids[:n])
        torch.cuda.synchronize()
        with torch.cuda.graph(G2, pool=gr.pool):
            lg2, _ = gr._forward(g.batch)
            argmax_rows(lg2[:n], out=gr.input_ids[:n])
    scratch = torch.empty(3 * g.n_tokens + g.n_reqs, dtype=torch.int64, device="cuda")
    hold = []

    def g2_memcpy():
        gr._fill(key, g, d, n)
        G2.replay()
        hold.append(torch.empty(n, dtype=torch.int64, pin_memory=True).copy_(gr.input_ids[:n], non_blocking=True))
        torch.cuda.Event().record()

    def g2_none():
        gr._fill(key, g, d, n)
        G2.replay()
        torch.cuda.Event().record()

    def rows_host():  # the graph as now, arg-max after it writing the pinned token itself
        gr._fill(key, g, d, n)
        gr.input_ids[:n].copy_(state["tok"])
        g.graph.replay()
        h = torch.empty(n, dtype=torch.int64, pin_memory=True)
        state["tok"] = argmax_rows(g.logits[:n], host=h)
        hold.append(h)
        torch.cuda.Event().record()

    def g2_pack_none():
        scratch.copy_(torch.zeros(scratch.shape, dtype=torch.int64), non_blocking=True)
        G2.replay()
        torch.cuda.Event().record()

    with torch.inference_mode():
        for name, fn in [
            ("G2 replay", G2.replay),
            ("G2 +fill", g2_none),
            ("G2 +fill +d2h memcpy", g2_memcpy),
            ("G2 +1 copy (stand-in)", g2_pack_none),
            ("graph +fill +argmax(host)", rows_host),
        ]:
            fn()
            row[name] = timed(fn, a.reps)
            hold.clear()
    G2.reset()
    row.update(
        {
            "batch": B,
            "ctx": a.ctx,
            "engine_tpot_us": tpot,
            "engine_wait_us_median": wait_us,
            "engine_run_span_us_median": statistics.median(spans),
            "engine_gap_between_runs_us_median": statistics.median(gaps),
        }
    )
    for name, fn in [
        ("replay", rep),
        ("+argmax", rep_argmax),
        ("+d2h", rep_d2h),
        ("+d2d", rep_d2d),
        ("+fill", rep_fill),
        ("+fill, wait N-1", rep_fill_wait),
    ]:
        fn()
        row[name] = timed(fn, a.reps)
    for k in list(row)[:5]:  # the alternatives last
        row[k] = row.pop(k)
    print(
        f"batch {B} ctx {a.ctx}: engine TPOT {tpot:.1f} us (host waits {wait_us:.0f} us a step; GPU: run() span "
        f"{row['engine_run_span_us_median']:.1f}, gap to the next {row['engine_gap_between_runs_us_median']:.1f})"
    )
    for name in [
        "replay",
        "+argmax",
        "+d2h",
        "+d2d",
        "+fill",
        "+fill, wait N-1",
        "G2 replay",
        "G2 +fill",
        "G2 +fill +d2h memcpy",
        "G2 +1 copy (stand-in)",
        "graph +fill +argmax(host)",
    ]:
        print(f"   {name:26s} {row[name]:8.1f} us a step")
    while engine.has_unfinished():  # finish this batch before the next
        for r in list(engine.states):
            engine.abort_request(r)
        engine.step()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/m1")
    ap.add_argument("--make", default="moonlight-16b-a3b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()
    if not os.path.isdir(a.model):
        from mlaserve.models.make_random import make_random

        make_random(a.make, a.model, dtype="bfloat16", device="cuda", progress=False)
    from mlaserve.engine.engine import LLMEngine

    batches = [int(b) for b in a.batches.split(",")]
    engine = LLMEngine(
        EngineConfig(
            model=a.model,
            enable_prefix_caching=False,
            max_num_seqs=max(batches),
            prefill_graph_max_tokens=1024,
            max_model_len=a.ctx + 4 * a.reps + 512,
        )
    )
    V = engine.model_config.vocab_size
    res = {"gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv), **code_id(), "rows": []}
    for B in batches:
        res["rows"].append(probe_batch(engine, B, a, V))
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
