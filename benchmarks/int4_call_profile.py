"""Per-kernel GPU time of one INT4 MoE call (int4_fused_experts, the GEMM form) and of bf16 `fused_experts` on the
same weights dequantized: Kimi-K2.5's experts (7168 -> 2048, 8 of 384, uniform random routing) at 8,192 and 2,048
tokens, torch.profiler over 5 calls after 3 untimed. Shows which GEMM trails bf16's.

    PYTHONPATH=$PWD python benchmarks/int4_call_profile.py     # JSON to $OUT/int4_call_profile.json (default out/)

Needs a GPU and ~45 GB of its memory.
"""

from __future__ import annotations

import json

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_engine import kernel_rows
from benchmarks.bench_util import moe_inputs, save_json
from benchmarks.int4_moe_bench import dequant_bf16
from mlaserve.kernels.fused_moe import fused_experts
from mlaserve.kernels.int4_moe import int4_fused_experts
from tests.helpers.int4_ref import random_int4_experts

D, I, E, K = 7168, 2048, 384, 8
REPS = 5


def kernel_ms(fn) -> dict[str, float]:
    """ms a call per CUDA kernel name."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(REPS):
            fn()
        torch.cuda.synchronize()
    return {name[:60]: round(ms / REPS, 3) for name, ms, _ in kernel_rows(p)}


def main() -> None:
    torch.manual_seed(0)
    w = random_int4_experts(E, D, I, "cuda")
    w13, w2 = dequant_bf16(w, D, I)
    res = {}
    for T in (8192, 2048):
        x, ids, tw = moe_inputs(T, D, E, K, "cuda")
        res[f"int4 T={T}"] = kernel_ms(lambda: int4_fused_experts(x, *w, tw, ids, 0))
        res[f"bf16 T={T}"] = kernel_ms(lambda: fused_experts(x, w13, w2, tw, ids, 0))
        for name in ("int4", "bf16"):
            print(f"{name} T={T}", json.dumps(dict(list(res[f"{name} T={T}"].items())[:5])), flush=True)
    save_json("int4_call_profile.json", [dict(case=k, kernels_ms=v) for k, v in res.items()])


if __name__ == "__main__":
    main()
