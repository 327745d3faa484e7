"""Does programmatic dependent launch (PDL, Hopper) shorten a dependent chain of small kernels inside a CUDA graph?

A batch-1 decode step is ~400 dependent kernels; each pays a launch gap and a cold start. With PDL a kernel is
launched before its predecessor ends: it may load its weights (which no kernel writes) and then waits
(`griddepcontrol.wait`) before it reads the activations. This probe times chains of GEMVs ([2048, 2048] bf16,
each on its own weight, 24 of them so L2 holds none) and of GEMV + a one-program add, captured in a graph:

    base      no PDL
    wait      PDL launch, wait first (hides only the launch gap)
    pre       PDL launch, weights loaded before the wait, dependents released after it
    pre_early weights before the wait, dependents released at the top

and checks every variant's chain output is bit-equal to base's. PYTHONPATH=$PWD python benchmarks/pdl_probe.py
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _gemv(X, W, Y, K: tl.constexpr, stride_wn, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, K)
    if MODE == 1:
        gdc_wait()
    if MODE == 3:
        gdc_launch_dependents()
    w = tl.load(W + n.to(tl.int64)[:, None] * stride_wn + k[None, :])
    if MODE >= 2:
        gdc_wait()
    if MODE == 2:
        gdc_launch_dependents()
    x = tl.load(X + k)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(Y + n, acc.to(Y.dtype.element_ty))


@triton.jit
def _add(X, B, Y, D: tl.constexpr, MODE: tl.constexpr):
    d = tl.arange(0, D)
    if MODE == 3:
        gdc_launch_dependents()
    b = tl.load(B + d)
    if MODE >= 1:
        gdc_wait()
    if MODE == 2:
        gdc_launch_dependents()
    x = tl.load(X + d).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / D + 1e-6) + b.to(tl.float32)
    tl.store(Y + d, y.to(Y.dtype.element_ty))


MODES = {"base": 0, "wait": 1, "pre": 2, "pre_early": 3}


def chain(x, ws, bs, bufs, mode: int, with_add: bool):
    cur = x
    for i, w in enumerate(ws):
        y = bufs[2 * i]
        _gemv[(w.shape[0] // 2,)](
            cur, w, y, K=w.shape[1], stride_wn=w.stride(0), BLOCK_N=2, MODE=mode, num_warps=2, launch_pdl=mode > 0
        )
        cur = y
        if with_add:
            z = bufs[2 * i + 1]
            _add[(1,)](cur, bs[i], z, D=z.shape[-1], MODE=mode, num_warps=4, launch_pdl=mode > 0)
            cur = z
    return cur


def main():
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    n, D = 24, 2048
    ws = [torch.randn(D, D, device=dev, dtype=bf) / D**0.5 for _ in range(n)]
    bs = [torch.randn(D, device=dev, dtype=bf) for _ in range(n)]
    x = torch.randn(1, D, device=dev, dtype=bf)
    rows, ref = [], {}
    for with_add in (False, True):
        for name, mode in MODES.items():
            bufs = [torch.full((1, D), float("nan"), device=dev, dtype=bf) for _ in range(2 * n)]
            chain(x, ws, bs, bufs, mode, with_add)  # compile
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = chain(x, ws, bs, bufs, mode, with_add)
            for b in bufs:
                b.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            res = out.clone()
            if name == "base":
                ref[with_add] = res
            equal = bool(torch.equal(res, ref[with_add]))
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 200
            t0.record()
            for _ in range(reps):
                g.replay()
            t1.record()
            torch.cuda.synchronize()
            us = t0.elapsed_time(t1) * 1e3 / reps
            kernels = n * (2 if with_add else 1)
            floor_us = n * D * D * 2 / 4.3e12 * 1e6
            rows.append(
                dict(
                    chain="gemv+add" if with_add else "gemv",
                    mode=name,
                    step_us=us,
                    us_per_kernel=us / kernels,
                    floor_us=floor_us,
                    equal_to_base=equal,
                )
            )
            print(
                f"{rows[-1]['chain']:9s} {name:10s} {us:8.1f} us/replay  {us / kernels:6.2f} us/kernel  "
                f"floor {floor_us:6.1f} us  x{us / floor_us:4.2f}  equal={equal}",
                flush=True,
            )
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "pdl_probe.json"), "w") as f:
        json.dump(
            dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows),
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
