"""The W8A8 FP8 MoE at one prefill step, a few tile configs side by side (one call = GEMM1, GEMM2, the quantizations
and the top-k sum): DeepSeek-V3's experts (7168 -> 2048, 8 of 256) by default; each timed call takes the next of 4
random routings; min over 3 rounds of 8 calls; rel = relative difference to the first config's output; then each
kernel's time in one call (torch.profiler; under PDL a kernel's duration includes its wait for the one before).

    PYTHONPATH=$PWD python benchmarks/fp8_moe_tiles.py                      # default, and the tiles below
    PYTHONPATH=$PWD python benchmarks/fp8_moe_tiles.py --tiles '{"a": {}, "b": {"gemm1": {"num_warps": 8}}}'

Writes $OUT/fp8_moe_tiles.json (OUT defaults to ./out). Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mlaserve.kernels.fp8_moe import fp8_fused_experts
from tests.helpers.fp8_checks import make_fp8_experts, moe_routing

TILES = {
    "default": {},
    "gemm1 128 wide, 8 warps (h quantized in its epilogue)": dict(gemm1=dict(BLOCK_N=128, num_warps=8)),
    "gemm1 64 wide, 8 warps": dict(gemm1=dict(BLOCK_N=64, num_warps=8)),
    "128-row blocks, gemm1 64 wide": dict(BLOCK_M=128, gemm1=dict(BLOCK_N=64, num_warps=8), gemm2=dict(num_warps=8)),
}


def kernel_times(call, reps: int = 4) -> dict[str, float]:
    """us a call per GPU kernel (torch.profiler over `reps` calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_time_total > 0]
    return {e.key[:40]: e.device_time_total / reps for e in sorted(ev, key=lambda e: -e.device_time_total)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shape", default="7168,2048,256,8", help="D,I,E,K")
    ap.add_argument("--tiles", default=None, help="JSON {label: fp8_moe_config overrides}")
    a = ap.parse_args()
    T = a.tokens
    D, I, E, K = (int(v) for v in a.shape.split(","))
    tiles = json.loads(a.tiles) if a.tiles else TILES
    w13, s13, w2, s2 = make_fp8_experts("cuda", E=E, D=D, I=I)
    x = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    routings = [moe_routing("cuda", T=T, K=K, E_total=E) for _ in range(4)]
    flops = 2 * T * K * 3 * D * I
    rows, first = {}, None
    for label, tile in tiles.items():
        cfg = dict(tile, a8=True, gemv=False)
        t0 = time.perf_counter()
        out = fp8_fused_experts(x, w13, s13, w2, s2, routings[0][1], routings[0][0], config=cfg).float()
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
        first = out if first is None else first
        rel = ((out - first).norm() / first.norm()).item()
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(8):
                ids, w = routings[i % 4]
                fp8_fused_experts(x, w13, s13, w2, s2, w, ids, config=cfg)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 8)
        ms = min(times)
        kernels = kernel_times(
            lambda: fp8_fused_experts(x, w13, s13, w2, s2, routings[1][1], routings[1][0], config=cfg)
        )
        rows[label] = dict(
            config=tile, ms=ms, tflops=flops / ms / 1e9, rel=rel, times_ms=times, first_s=first_call_s, kernels=kernels
        )
        print(f"{label:55s} {ms:7.2f} ms {flops / ms / 1e9:6.0f} TFLOP/s  rel {rel:.2e}", flush=True)
        print("    " + ", ".join(f"{k} {v:.0f} us" for k, v in kernels.items()), flush=True)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, tokens=T, shape=dict(D=D, I=I, E=E, K=K))
    with open(os.path.join(out_dir, "fp8_moe_tiles.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
