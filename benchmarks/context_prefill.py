"""TTFT of a prefill chunk over cached context in three forms, on one engine in rotating rounds: the engine's default
("graph": a suffix of at most SUFFIX_MAX_TOKENS tokens as absorbed decode rows in a suffix graph, engine/suffix.py;
longer chunks a context graph), the context graph alone ("context": GraphRunner.suffix_sizes emptied), and one eager
forward in the naive form ("eager": the graphs' lists emptied and the runner's suffix rows off). The engine is
made with KernelConfig.absorbed_suffix on whatever MLASERVE_ABSORBED_SUFFIX says:

- a prefix hit's suffix: a prefix of P tokens cached (an earlier request's), then a request of that prefix and S new
  tokens, timed from add_request to its first token's event;
- a long prompt in chunks: L tokens with --chunk tokens a step, every chunk after the first over cached context.

Each figure is beside its floor (bench/roofline.chunk_floor_s: the FLOPs' time or the reads', whichever is longer).

    python benchmarks/context_prefill.py --preset moonlight-16b-a3b   # M1, random weights in place
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_engine import prompts, sync  # noqa: E402
from benchmarks.bench_util import code_id  # noqa: E402
from mlaserve.bench.roofline import chunk_floor_s  # noqa: E402
from mlaserve.config import EngineConfig, ModelConfig  # noqa: E402
from mlaserve.kernel_config import KernelConfig  # noqa: E402
from mlaserve.types import SamplingParams  # noqa: E402


def first_token_ms(engine, prompt: list[int]) -> tuple[float, int]:
    """ms from add_request to the step that returns the request's first token, and the steps it took."""
    sync()
    t = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    steps = 0
    while True:
        steps += 1
        if any(o.request_id == rid and o.new_token_ids for o in engine.step()):
            break
    sync()
    ms = (time.perf_counter() - t) * 1e3
    while engine.has_unfinished():
        engine.step()
    return ms, steps


MODES = ("graph", "context", "eager")


def timed_rounds(engine, make_prompt, reps: int) -> dict:
    """reps rounds, each one prompt in each mode (the order rotating), after one untimed round -> per mode the
    times, their median, the steps and the context and suffix graphs replayed."""
    import mlaserve.engine.runner as runner_mod

    gr = engine.runner.graphs
    buckets, sizes, rows = gr.context_buckets, gr.suffix_sizes, runner_mod.suffix_rows
    out = {m: dict(ms=[], steps=0, context_replays=0, suffix_replays=0) for m in MODES}
    for r in range(reps + 1):
        for m in MODES[r % 3 :] + MODES[: r % 3]:
            gr.context_buckets = [] if m == "eager" else buckets
            gr.suffix_sizes = sizes if m == "graph" else []
            runner_mod.suffix_rows = rows if m == "graph" else (lambda p: None)
            before = dict(gr.graph_replays)
            ms, steps = first_token_ms(engine, make_prompt(r, m))
            if r:
                out[m]["ms"].append(ms)
                out[m]["steps"] = steps
                for kind in ("context", "suffix"):
                    out[m][f"{kind}_replays"] = gr.graph_replays[kind] - before.get(kind, 0)
    gr.context_buckets, gr.suffix_sizes, runner_mod.suffix_rows = buckets, sizes, rows
    for m in out.values():
        m["median_ms"] = statistics.median(m["ms"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="moonlight-16b-a3b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prefixes", default="1024,4096,8192", help="cached prefix tokens P")
    ap.add_argument("--suffixes", default="8,32,256,1024,2048", help="new tokens S after the prefix")
    ap.add_argument("--long", type=int, default=16384, help="a prompt of this many tokens in chunks (0: none)")
    ap.add_argument("--chunk", type=int, default=2048, help="its chunk (chunked_prefill_size)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warm", type=int, default=8, help="untimed rounds before the sweep")
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument(
        "--suffix-max-tokens", type=int, default=None, help="suffix.SUFFIX_MAX_TOKENS for this run (where to cut)"
    )
    a = ap.parse_args()
    if a.suffix_max_tokens is not None:
        import mlaserve.engine.suffix as suffix_mod

        suffix_mod.SUFFIX_MAX_TOKENS = a.suffix_max_tokens

    from mlaserve.engine.engine import LLMEngine
    from mlaserve.models.make_random import make_random

    path = make_random(a.preset, "/tmp/cfg-context", layers=a.layers, dtype="bfloat16", config_only=True)
    mcfg = ModelConfig.from_pretrained(path)
    vocab = mcfg.vocab_size
    prefixes = [int(x) for x in a.prefixes.split(",") if x]
    suffixes = [int(x) for x in a.suffixes.split(",") if x]
    max_len = max([p + s for p in prefixes for s in suffixes] + [a.long]) + 64
    kernels = dataclasses.replace(KernelConfig.from_env(), absorbed_suffix=True)  # the suffix graphs
    cfg = EngineConfig(
        model=path, load_format="dummy", max_num_seqs=8, warmup=False, max_model_len=max_len, kernels=kernels
    )
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mlaserve.cuda_graph").setLevel(logging.INFO)  # the capture's line: graphs and seconds
    engine = LLMEngine(cfg)
    res = dict(
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        command=" ".join(sys.argv),
        **code_id(),
        context_buckets=engine.runner.graphs.context_buckets,
        suffix=[],
        long=None,
    )
    print(
        f"{'P cached':>9s} {'S new':>6s} {'graph ms':>9s} {'context':>9s} {'eager ms':>9s} {'floor ms':>9s} "
        f"{'graph x':>8s} {'speedup':>8s}"
    )
    # the eager forward's first runs are slower (host and allocator settling): untimed rounds of the first shape
    warm = prompts(1, prefixes[0], vocab, seed=49)[0]
    first_token_ms(engine, warm)
    timed_rounds(engine, lambda r, m: warm + prompts(1, suffixes[0], vocab, seed=r)[0], a.warm)
    for i, P in enumerate(prefixes):
        prefix = prompts(1, P, vocab, seed=50 + i)[0]
        first_token_ms(engine, prefix)  # cached: its full pages stay in the prefix cache
        for S in suffixes:

            def make(r, m, P=P, S=S, prefix=prefix):
                return prefix + prompts(1, S, vocab, seed=1000 * P + 10 * S + 3 * r + MODES.index(m))[0]

            t = timed_rounds(engine, make, a.reps)
            fl = chunk_floor_s(mcfg, S, P) * 1e3
            g, c, e = (t[m]["median_ms"] for m in MODES)
            res["suffix"].append(dict(cached=P, new=S, floor_ms=fl, **t))
            print(
                f"{P:9d} {S:6d} {g:9.2f} {c:9.2f} {e:9.2f} {fl:9.2f} {g / fl:8.2f} {e / g:8.2f}  (replayed: suffix "
                f"{t['graph']['suffix_replays']}, context {t['graph']['context_replays']} / "
                f"{t['context']['context_replays']} / {t['eager']['context_replays']})"
            )
    if a.long:
        chunked = LLMEngine(
            EngineConfig(
                model=path,
                load_format="dummy",
                max_num_seqs=8,
                warmup=False,
                max_model_len=max_len,
                chunked_prefill_size=a.chunk,
                enable_prefix_caching=False,
                kernels=kernels,
            ),
            runner=engine.runner,
        )
        t = timed_rounds(chunked, lambda r, m: prompts(1, a.long, vocab, seed=7 + 3 * r + MODES.index(m))[0], a.reps)
        n = -(-a.long // a.chunk)
        fl = sum(chunk_floor_s(mcfg, min(a.chunk, a.long - k * a.chunk), k * a.chunk) for k in range(n)) * 1e3
        g, e = t["graph"]["median_ms"], t["eager"]["median_ms"]
        res["long"] = dict(tokens=a.long, chunk=a.chunk, floor_ms=fl, **t)
        print(
            f"\n{a.long}-token prompt in {n} chunks of {a.chunk}: graph {g:.1f} ms, eager {e:.1f} ms, floor {fl:.1f} "
            f"ms ({g / fl:.2f}x; eager {e / fl:.2f}x); context graphs replayed {t['graph']['context_replays']}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
