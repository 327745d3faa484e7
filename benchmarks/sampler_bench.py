"""The sampler on sampled rows: the race kernel (kernels/race_sample.py) against the torch reference it replaces
(the sort-based filter, softmax, argmax(p / E): ~20 launches a call), same inputs, same run. Per call: wall time
(back to back, one sync at the end: what a host-bound step pays) and GPU kernel time (torch.profiler). Needs a GPU.

    PYTHONPATH=$PWD python benchmarks/sampler_bench.py        # JSON to $OUT/sampler_bench.json (default out/)
"""

from __future__ import annotations

import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mlaserve.layers import sampler
from mlaserve.layers.sampler import SamplingRow, sample
from mlaserve.types import SamplingParams

SETS = {
    "temp 1.0": dict(temperature=1.0),
    "temp 0.7, top_p 0.95": dict(temperature=0.7, top_p=0.95),
    "temp 1.0, top_k 50": dict(temperature=1.0, top_k=50),
    "temp 1.0, min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "temp 0.7, top_k 50, top_p 0.95": dict(temperature=0.7, top_k=50, top_p=0.95),
}


def timed(logits, rows, gen, reps=50):
    for _ in range(5):
        sample(logits, rows, gen)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        sample(logits, rows, gen)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            sample(logits, rows, gen)
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.time_range.end - e.time_range.start for e in ev) / 10
    return wall, gpu, len(ev) / 10


def main():
    out = []
    fused, cand = sampler._fused, sampler._candidates
    gen = torch.Generator(device="cuda").manual_seed(0)
    for V in (163840, 8192):
        for B in (1, 8, 32):
            logits = torch.randn(B, V, device="cuda") * 3
            for name, kw in SETS.items():
                rows = [SamplingRow(SamplingParams(**kw), None) for _ in range(B)]
                r = dict(V=V, B=B, params=name)
                for mode in ("reference", "race kernel"):
                    ref = mode == "reference"
                    sampler._fused = (lambda p, V: False) if ref else fused
                    sampler._candidates = (lambda p, V: False) if ref else cand
                    wall, gpu, n = timed(logits, rows, gen)
                    r[mode] = dict(wall_us=wall, gpu_us=gpu, kernels=n)
                sampler._fused, sampler._candidates = fused, cand
                out.append(r)
                a, b = r["reference"], r["race kernel"]
                print(
                    f"V {V:6d} B {B:2d} {name:30s} reference {a['wall_us']:7.1f} us wall {a['gpu_us']:7.1f} GPU "
                    f"({a['kernels']:4.1f} kernels)  race {b['wall_us']:7.1f} wall {b['gpu_us']:7.1f} GPU "
                    f"({b['kernels']:4.1f})",
                    flush=True,
                )
    d = os.environ.get("OUT", "out")
    os.makedirs(d, exist_ok=True)
    json.dump(
        dict(gpu=torch.cuda.get_device_name(), rows=out), open(os.path.join(d, "sampler_bench.json"), "w"), indent=1
    )


if __name__ == "__main__":
    main()
