"""The host's cost of ForwardBatch.build (attention/base.py: an eager step's metadata, from the scheduler's chunks
to device tensors) on step shapes from one decode row to an 8,192-token prefill and a mixed step. On CUDA the time
includes queueing the copies, not their completion (the build does not wait for the stream). Run it from each tree
of an A/B (benchmarks/ab_trees.sh export ...; `cd ab/<tree> && PYTHONPATH=$PWD python benchmarks/batch_build_bench.py`).

    PYTHONPATH=$PWD python benchmarks/batch_build_bench.py [--device cpu|cuda] [--reps 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time

import torch

from mlaserve.attention.base import ForwardBatch, SeqChunk

# name: ([(tokens, cached)] of decode chunks, [(tokens, cached)] of prefill chunks)
SHAPES = {
    "decode, 1 request": ([(1, 500)], []),
    "decode, 64 requests": ([(1, 500)] * 64, []),
    "decode, 256 requests": ([(1, 900)] * 256, []),
    "verify N=2, 32 requests": ([(2, 500)] * 32, []),
    "prefill 2,048 after 6,144 cached": ([], [(2048, 6144)]),
    "prefill 8,192": ([], [(8192, 0)]),
    "prefill 8,184 + 8 decode rows": ([(1, 8000)] * 8, [(8184, 0)]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    rng = random.Random(0)

    def chunk(n: int, cached: int) -> SeqChunk:
        pages = rng.sample(range(1, 1 << 20), -(-(cached + n) // a.page_size))
        return SeqChunk([rng.randrange(50000) for _ in range(n)], cached, pages, "last")

    rows = []
    for name, (dec, pre) in SHAPES.items():
        d, p = [chunk(*x) for x in dec], [chunk(*x) for x in pre]
        ForwardBatch.build(d, p, a.page_size, a.device)  # warm (pinned blocks, allocator)
        t = time.perf_counter()
        for _ in range(a.reps):
            ForwardBatch.build(d, p, a.page_size, a.device)
        us = 1e6 * (time.perf_counter() - t) / a.reps
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        rows.append({"shape": name, "us": us})
        print(f"{name:34s} {us:9.1f} us")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    os.makedirs(a.out, exist_ok=True)
    res = {"device": a.device, "reps": a.reps, "torch": torch.__version__, "commit": commit, "rows": rows}
    with open(os.path.join(a.out, f"batch_build_{a.device}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
