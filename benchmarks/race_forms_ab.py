"""The race kernel's one-program form (kernels/race_sample.py) against 190d482's (row, chunk) form (not landed:
docs/experiments.md), same inputs, same process: tokens compared, then per call the eager wall time (calls back to
back, one sync) and the GPU time inside a CUDA graph of 20 calls. Needs a GPU and the git history.

    PYTHONPATH=$PWD python benchmarks/race_forms_ab.py        # JSON to $OUT/race_forms_ab.json (default out/)
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from mlaserve.kernels import race_sample as one

CHUNKED = "190d482"
path = os.path.join(tempfile.mkdtemp(), "race_chunk.py")
with open(path, "w") as f:
    f.write(subprocess.check_output(["git", "show", f"{CHUNKED}:mlaserve/kernels/race_sample.py"], text=True))
spec = importlib.util.spec_from_file_location("mlaserve.kernels.race_chunk", path)
chunk = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = chunk
spec.loader.exec_module(chunk)
SETS = {
    "temp 1.0": (1.0, 1.0, 0.0, 0),
    "top_p 0.95 t0.7": (1 / 0.7, 0.95, 0.0, 0),
    "top_k 50": (1.0, 1.0, 0.0, 50),
    "min_p 0.05": (1.0, 1.0, 0.05, 0),
}


def timeit(fn, reps=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps * 1e6
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return wall, s.elapsed_time(e) * 1e3 / 200  # us a call: 10 replays of 20 calls


rows = []
for V in (163840, 129280, 8192):
    for B in (1, 8, 32):
        torch.manual_seed(V + B)
        x = torch.randn(B, V, device="cuda") * 3
        noise = torch.empty(B, V, device="cuda").exponential_()
        for name, (it, tp, mp, k) in SETS.items():
            par = torch.tensor(
                [list(range(B)), list(range(B)), [it] * B, [tp] * B, [mp] * B, [float(k)] * B],
                dtype=torch.float32,
                device="cuda",
            )
            MP, CH = mp > 0, (k > 0 or tp < 1)
            o1 = torch.full((B,), -1, dtype=torch.int64, device="cuda")
            o2 = o1.clone()
            one.race_sample(x, noise, par, o1, MP, CH)
            chunk.race_sample(x, noise, par, o2, MP, CH)
            same = bool(torch.equal(o1, o2)) and bool((o1 >= 0).all())
            w1, g1 = timeit(lambda: one.race_sample(x, noise, par, o1, MP, CH))
            w2, g2 = timeit(lambda: chunk.race_sample(x, noise, par, o2, MP, CH))
            r = dict(
                V=V,
                B=B,
                params=name,
                same_tokens=same,
                one_wall_us=w1,
                one_graph_us=g1,
                chunk_wall_us=w2,
                chunk_graph_us=g2,
            )
            rows.append(r)
            print(
                f"V {V:6d} B {B:2d} {name:16s} same {same!s:5s} one {w1:6.1f} wall {g1:6.1f} graph | "
                f"chunk {w2:6.1f} wall {g2:6.1f} graph  x{g1 / g2:4.2f}",
                flush=True,
            )
os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
json.dump(
    dict(gpu=torch.cuda.get_device_name(), chunked=CHUNKED, rows=rows),
    open(os.path.join(os.environ.get("OUT", "out"), "race_forms_ab.json"), "w"),
    indent=1,
)
