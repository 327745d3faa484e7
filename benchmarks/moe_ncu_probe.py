"""The batch-1 fused MoE (M1: Moonlight's 64 experts top-6 plus 2 shared slots, D 2048, I 1408) over 8 layers'
weights in turn, as decode reads them, for Nsight Compute: why GEMM1 / GEMM2 stream at ~70 % of the bandwidth.

    PYTHONPATH=$PWD python benchmarks/moe_ncu_probe.py [--tma 0|1] [--reps 40]        # times it (CUDA events)
    ncu --kernel-name regex:_moe_gemm --launch-skip 16 --launch-count 4 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis_Chart \\
        python3 benchmarks/moe_ncu_probe.py --reps 3                                  # the counters
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlaserve.kernels.fused_moe import fused_experts  # noqa: E402

BF = torch.bfloat16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tma", type=int, default=None, help="force TMA weight tiles on (1) or off (0)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    D, I, E, K, S, L = 2048, 1408, 64, 6, 2, a.layers
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = [(torch.randn(E, 2 * I, D, device="cuda", generator=g) / D**0.5).to(BF) for _ in range(L)]
    w2 = [(torch.randn(E, D, I, device="cuda", generator=g) / I**0.5).to(BF) for _ in range(L)]
    sh = [tuple((torch.randn(*s, device="cuda", generator=g) / s[1] ** 0.5).to(BF)
                for s in ((S * I, D), (S * I, D), (D, S * I))) for _ in range(L)]
    x = torch.randn(1, D, device="cuda", generator=g).to(BF)
    ids = torch.cat([torch.randperm(E, device="cuda", generator=g)[:K], torch.arange(E, E + S, device="cuda")])[None]
    w = torch.cat([torch.rand(1, K, device="cuda", generator=g), torch.ones(1, S, device="cuda")], 1)
    cfg = None if a.tma is None else dict(tma=bool(a.tma))
    run = [lambda i=i: fused_experts(x, w13[i], w2[i], w, ids, 0, config=cfg, shared=sh[i]) for i in range(L)]
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
    us = start.elapsed_time(end) * 1e3 / (a.reps * L)
    gb = (K + S) * 3 * I * D * 2 / 1e9  # the 8 experts' gate, up and down weights
    print(f"fused MoE T=1 (tma={a.tma}): {us:.1f} us a layer, {gb / us * 1e3:.2f} TB/s "
          f"({100 * gb / us * 1e3 / 4.3:.0f} % of 4.3 TB/s)")


if __name__ == "__main__":
    main()
