"""The batch-1 fused MoE (M1: Moonlight's 64 experts top-6 plus 2 shared slots, D 2048, I 1408) as decode reads
it, layer after layer: why GEMM1 / GEMM2 stream at ~70 % of the bandwidth in the engine and 78 % in kernels_bench.

    PYTHONPATH=$PWD python benchmarks/moe_ncu_probe.py [--tma 0|1] [--reps 40]        # eager, CUDA events
    PYTHONPATH=$PWD python benchmarks/moe_ncu_probe.py --sweep [--layers 26]           # CUDA graphs, variants
    ncu --kernel-name regex:_moe_gemm --launch-skip 16 --launch-count 4 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis_Chart \\
        python3 benchmarks/moe_ncu_probe.py --reps 3                                  # the counters

--sweep captures one graph of `--layers` layers' MoE (each layer its own weights, the engine's footprint at 26) and
times its replays, per variant: the experts fixed (as kernels_bench) or drawn afresh for every layer before every
replay (as decode routes), TMA tiles or pointer loads, other tiles. One replay is profiled per kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlaserve.kernels.fused_moe import fused_experts  # noqa: E402

BF = torch.bfloat16
D, I, E, K, S = 2048, 1408, 64, 6, 2
GB = (K + S) * 3 * I * D * 2 / 1e9  # the 8 experts' gate, up and down weights read by one layer at T=1


def weights(L: int, g: torch.Generator):
    def rnd(*shape, fan):
        return torch.empty(*shape, device="cuda", dtype=BF).normal_(0, fan**-0.5, generator=g)
    return [(rnd(E, 2 * I, D, fan=D), rnd(E, D, I, fan=I), (rnd(S * I, D, fan=D), rnd(S * I, D, fan=D),
             rnd(D, S * I, fan=S * I))) for _ in range(L)]


def draw_ids(L: int, n: int, g: torch.Generator) -> torch.Tensor:
    """[n, L, 1, K + S]: K distinct routed experts per layer, then the shared slots E, E+1."""
    routed = torch.rand(n, L, E, device="cuda", generator=g).argsort(-1)[..., :K]
    shared = torch.arange(E, E + S, device="cuda").expand(n, L, S)
    return torch.cat([routed, shared], -1)[:, :, None].contiguous()


def time_graph(ws, cfg, random_ids: bool, reps: int, g) -> dict:
    L = len(ws)
    x = torch.randn(L, 1, D, device="cuda", generator=g).to(BF)
    w = torch.cat([torch.rand(L, 1, K, device="cuda", generator=g), torch.ones(L, 1, S, device="cuda")], -1)
    bank = draw_ids(L, reps if random_ids else 1, g)
    ids = bank[0].clone()

    def step():
        for i, (w13, w2, sh) in enumerate(ws):
            fused_experts(x[i], w13, w2, w[i], ids[i], 0, config=cfg, shared=sh)
    step()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(reps):
        ids.copy_(bank[r % bank.shape[0]])
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / L)
    times.sort()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and "_moe" in ev.name:
            n = ev.name.split("(")[0]
            per.setdefault(n, []).append(ev.device_time)
    med = times[len(times) // 2]
    return dict(us=med, best=times[0], tbps=GB / med * 1e3,
                kernels={n: sum(v) / len(v) for n, v in per.items()})


def sweep(a) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = weights(a.layers, g)
    t2 = dict(tma=True)
    variants = [
        ("default, fixed experts", None, False),
        ("default, fresh experts", None, True),
        ("pointer loads", dict(tma=False), True),
        ("tma g1 s3 g2 s4", dict(t2, gemm1=dict(num_stages=3), gemm2=dict(num_stages=4)), True),
        ("tma g1 N16 s3", dict(t2, gemm1=dict(BLOCK_N=16, num_stages=3)), True),
        ("tma g1 N64 s2", dict(t2, gemm1=dict(BLOCK_N=64, num_stages=2)), True),
        ("tma g1 K256 s2", dict(t2, gemm1=dict(BLOCK_K=256, num_stages=2)), True),
        ("tma g2 N32 s3", dict(t2, gemm2=dict(BLOCK_N=32, num_stages=3)), True),
        ("tma g2 N128 s2", dict(t2, gemm2=dict(BLOCK_N=128, num_stages=2)), True),
        ("tma g2 K256 s2", dict(t2, gemm2=dict(BLOCK_K=256, num_stages=2)), True),
        ("tma w8 both", dict(t2, num_warps=8), True),
    ]
    if a.only:
        variants = [v for v in variants if any(s in v[0] for s in a.only.split(","))]
    floor = GB / 4.3 * 1e3
    print(f"M1 MoE T=1, {a.layers} layers' weights; floor {floor:.1f} us a layer (gemm1 {floor * 2 / 3:.1f}, "
          f"gemm2 {floor / 3:.1f})")
    print(f"{'variant':28s} {'us/layer':>9s} {'best':>7s} {'% bw':>5s}  gemm1 / gemm2 / sum (profiled us)")
    rows = []
    for name, cfg, rnd in variants:
        try:
            r = time_graph(ws, cfg, rnd, a.reps, g)
        except Exception as e:  # a tile that does not fit: report, go on
            print(f"{name:28s} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        k = r["kernels"]
        parts = " / ".join(f"{v:.1f}" for n, v in sorted(k.items()))
        print(f"{name:28s} {r['us']:9.1f} {r['best']:7.1f} {100 * r['tbps'] / 4.3:4.0f}%  {parts}")
        rows.append(dict(variant=name, config=cfg, random_ids=rnd, **r))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_probe_sweep.json"), "w") as f:
            json.dump(dict(layers=a.layers, floor_us=floor, rows=rows), f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tma", type=int, default=None, help="force TMA weight tiles on (1) or off (0)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="graph-timed variants (see the docstring)")
    ap.add_argument("--only", default="", help="--sweep: variants whose name contains one of these (comma list)")
    a = ap.parse_args()
    if a.sweep:
        return sweep(a)
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = weights(a.layers, g)
    x = torch.randn(1, D, device="cuda", generator=g).to(BF)
    ids = draw_ids(1, 1, g)[0, 0]
    w = torch.cat([torch.rand(1, K, device="cuda", generator=g), torch.ones(1, S, device="cuda")], 1)
    cfg = None if a.tma is None else dict(tma=bool(a.tma))
    run = [lambda w13=w13, w2=w2, sh=sh: fused_experts(x, w13, w2, w, ids, 0, config=cfg, shared=sh)
           for w13, w2, sh in ws]
    for f in run:  # compile, warm up
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.reps):
        for f in run:
            f()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (a.reps * len(run))
    print(f"fused MoE T=1 (tma={a.tma}), eager: {us:.1f} us a layer, {GB / us * 1e3:.2f} TB/s "
          f"({100 * GB / us * 1e3 / 4.3:.0f} % of 4.3 TB/s)")


if __name__ == "__main__":
    main()
