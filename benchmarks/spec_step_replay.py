"""The greedy EAGLE3 step's GPU time alone, M1 shapes (weights made in place, a random draft): for a running batch of
1 and 8 requests at 512 tokens, its step graph (engine/spec_graph.py) replayed back to back, against the verify's
graph and the draft's graph replayed back to back (the launches path's two graphs, without its small kernels), and
each alone; and the host's time in one replay. Needs a GPU. With --model and --draft, a checkpoint and its draft
from disk instead (the shipped default model: mlaserve/assets/pycode-13m and pycode-13m-eagle3), whose step is
short enough that the loop's timing is at the mercy of the host: the replays here are the GPU's time alone.
--profile adds the verify graph's and the draft graph's kernels (torch.profiler over 16 replays), their time a
replay, most first.

    PYTHONPATH=$PWD python benchmarks/spec_step_replay.py [--rounds 3] [--profile]
    PYTHONPATH=$PWD python benchmarks/spec_step_replay.py --model mlaserve/assets/pycode-13m \
        --draft mlaserve/assets/pycode-13m-eagle3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks.*
from benchmarks import bench_engine as be  # noqa: E402
from benchmarks.bench_util import back_to_back_ms as timed  # noqa: E402
from mlaserve.config import EngineConfig, ModelConfig, SpecConfig  # noqa: E402
from mlaserve.engine.engine import LLMEngine  # noqa: E402
from mlaserve.models.make_random import make_random  # noqa: E402
from mlaserve.models.make_random_draft import make_random_draft  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft", default="/tmp/m1-dummy-draft", help="made for M1 if absent (not with --model)")
    ap.add_argument("--profile", action="store_true", help="the verify's and the draft's kernels a replay")
    ap.add_argument("--model", default=None, help="a checkpoint on disk (default: M1 shapes, weights made in place)")
    a = ap.parse_args()
    if a.model is not None:
        path, load = a.model, "auto"
    else:
        path = make_random("moonlight-16b-a3b", "/tmp/cfg-spec-replay", dtype="bfloat16", config_only=True)
        load = "dummy"
        if not os.path.isdir(a.draft):
            make_random_draft("kimi-k2.5-eagle3", a.draft, target=path, dtype="bfloat16")
    vocab = ModelConfig.from_pretrained(path).vocab_size
    cfg = EngineConfig(
        model=path,
        load_format=load,
        gpu_memory_utilization=0.9,
        enable_prefix_caching=False,
        max_num_seqs=8,
        warmup=False,
        max_model_len=1024,
    )
    eng = LLMEngine(cfg, spec=SpecConfig(draft_model=a.draft, num_steps=1, num_draft_tokens=2))
    for b in (1, 8):
        rids = be.start_batch(eng, b, 512, vocab, be.tpot_max_tokens(eng, b, 512, 40))
        for _ in range(8):
            eng.step()
        torch.cuda.synchronize()
        sg = eng.spec_step_graphs
        B = next(x for x in sg.bs_list if x >= b)
        step_g = sg.graphs[B]
        verify_g = eng.runner.graphs.graphs[("decode", B)].graph
        draft_g = eng.proposer.graphs.graphs[B][0]
        torch.cuda.synchronize()
        host = []
        for _ in range(8):
            t = time.perf_counter()
            step_g.replay()
            host.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        print(f"batch {b}: host ms in each of 8 step-graph replays: " + " ".join(f"{x:.3f}" for x in host))
        res: dict[str, list[float]] = {}
        for _ in range(a.rounds):
            res.setdefault("step graph", []).append(timed(step_g.replay))
            res.setdefault("verify + draft graphs", []).append(timed(lambda: (verify_g.replay(), draft_g.replay())))
            res.setdefault("verify graph", []).append(timed(verify_g.replay))
            res.setdefault("draft graph", []).append(timed(draft_g.replay))
        for k, v in res.items():
            print(f"batch {b}: {k:<22} " + " / ".join(f"{x:.3f}" for x in v) + " ms")
        if a.profile:
            for name, g in (("verify graph", verify_g), ("draft graph", draft_g)):
                kernels(f"batch {b}: {name}", g.replay)
        for r in rids:  # the replays rewrote the last step's KV rows: end the requests
            eng.abort_request(r)
        while eng.has_unfinished():
            eng.step()


def kernels(title: str, replay, n: int = 16, top: int = 25) -> None:
    """Print the kernels of `n` replays by GPU time, per replay."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            replay()
        torch.cuda.synchronize()
    rows = be.kernel_rows(prof)
    total = 1e3 * sum(r[1] for r in rows) / n
    print(f"{title}: {total:.1f} us of kernels a replay, {sum(r[2] for r in rows) / n:.0f} kernels")
    for k, ms, c in rows[:top]:
        print(f"  {1e3 * ms / n:8.1f} us {c / n:5.1f}x {1e3 * ms / c:7.2f} us  {k[:90]}")


if __name__ == "__main__":
    main()
