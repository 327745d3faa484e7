"""The INT4 MoE's grouped GEMM form at prefill steps, tile configs side by side: one `int4_fused_experts` call
(moe_align, GEMM1, GEMM2, the top-k sum) on Kimi-K2.5's experts (7168 -> 2048, 8 of 384, random routing) at 8,192
and 2,048 tokens (INT4_TILES_T: other counts), against bf16 `fused_experts` on the same weights dequantized; median
of 8 calls; rel = relative difference to the bf16 output. "T" configs compute both GEMMs transposed (int4_gemm.py's
TRANS).

    PYTHONPATH=$PWD python benchmarks/int4_moe_tiles.py
    INT4_TILES_T=256,512,1024 PYTHONPATH=$PWD python benchmarks/int4_moe_tiles.py
    INT4_TILES_ONLY="default,GEMM1 default" PYTHONPATH=$PWD python benchmarks/int4_moe_tiles.py

INT4_TILES_ONLY: comma-separated name prefixes; only the variants whose names start with one of them.

Writes $OUT/int4_moe_tiles.json (OUT defaults to out/). Needs a GPU and ~45 GB of its memory.
"""

from __future__ import annotations

import os

import torch

from benchmarks.bench_util import moe_inputs, rel, save_json
from benchmarks.int4_moe_bench import dequant_bf16
from mlaserve.kernels.fused_moe import fused_experts
from mlaserve.kernels.int4_moe import gemm_config, int4_fused_experts
from tests.helpers.int4_ref import random_int4_experts

D, I, E, K = 7168, 2048, 384, 8


def C(bm, bn, bk, w, s, trans=False, group=8):
    # TRANS and TAIL always set: int4_fused_experts merges a config into the defaults, whose own would otherwise stand
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=w, num_stages=s, TRANS=trans, TAIL=None)


def tail64(c):
    # the default's tail tiles (gemm_config's 64-row band: 64/128/64, 4 warps, 3 stages, transposed) under c
    return dict(c, TAIL=dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3, TRANS=True))


def both(c):
    return c, c


VARIANTS = {  # name: (gemm1, gemm2); None: the defaults (gemm_config)
    "default": None,
    # above 64 rows an expert: each expert's last rows, if at most 64, in 64-row tiles (moe_align's tail list)
    "default without the tail list (before 2026-12-07)": both(dict(TAIL=None)),
    "128/128/64 w8 s3 (the default above 96 rows before d796d58)": both(C(128, 128, 64, 8, 3)),
    "128/128/64 w8 s4": both(C(128, 128, 64, 8, 4)),
    "T 128/128/64 w8 s3": both(C(128, 128, 64, 8, 3, True)),
    "T 128/128/64 w8 s4": both(C(128, 128, 64, 8, 4, True)),
    "T 64/128/64 w8 s3": both(C(64, 128, 64, 8, 3, True)),
    "T 64/128/64 w4 s3": both(C(64, 128, 64, 4, 3, True)),
    "T 64/128/64 w4 s3 + tail 32/64/128": both(
        dict(C(64, 128, 64, 4, 3, True), TAIL=dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128))
    ),
    "T 128/64/64 w4 s3": both(C(128, 64, 64, 4, 3, True)),
    "T 128/128/128 w8 s3": both(C(128, 128, 128, 8, 3, True)),
    "T 64/64/64 w4 s4": both(C(64, 64, 64, 4, 4, True)),
    "T 32/128/64 w8 s3": both(C(32, 128, 64, 8, 3, True)),
    "T 32/128/64 w4 s4": both(C(32, 128, 64, 4, 4, True)),
    "GEMM1 only T 128/128/64 w8 s3": (C(128, 128, 64, 8, 3, True), C(128, 128, 64, 8, 3)),
    "16/64/64 w4 s3 (the default up to 8 rows an expert before d7b3f0d)": both(C(16, 64, 64, 4, 3, group=1)),
    "32/64/64 w4 s3 (the default from 8 to 24 rows before d7b3f0d)": both(C(32, 64, 64, 4, 3, group=1)),
    "T 32/64/128 w4 s3": both(C(32, 64, 128, 4, 3, True)),
    # the default up to 24 rows an expert (T 32/64/128 w4 s3) with more bytes in flight a program: deeper pipelines,
    # longer K steps, more weight rows
    "T 32/64/128 w4 s4": both(C(32, 64, 128, 4, 4, True)),
    "T 32/64/128 w4 s5": both(C(32, 64, 128, 4, 5, True)),
    "T 32/64/256 w4 s3": both(C(32, 64, 256, 4, 3, True)),
    "T 32/64/256 w4 s4": both(C(32, 64, 256, 4, 4, True)),
    "T 32/128/128 w8 s4": both(C(32, 128, 128, 8, 4, True)),
    "T 16/64/64 w4 s3": both(C(16, 64, 64, 4, 3, True)),
    "GEMM2 only T 128/128/64 w8 s3": (C(128, 128, 64, 8, 3), C(128, 128, 64, 8, 3, True)),
    # GEMM2's own tiles beside GEMM1's default, both with the default's tail tiles (128-row blocks: 8,192 tokens;
    # elsewhere BLOCK_M disagrees, skipped)
    "GEMM1 default, GEMM2 T 128/64/64 w4 s3 (the default at 128-row blocks before 264595e)": (
        {},
        tail64(C(128, 64, 64, 4, 3, True)),
    ),
    "GEMM1 default, GEMM2 T 128/128/64 w8 s3": ({}, tail64(C(128, 128, 64, 8, 3, True))),
    "GEMM1 default, GEMM2 T 128/64/128 w4 s3": ({}, tail64(C(128, 64, 128, 4, 3, True))),
    "GEMM1 default, GEMM2 T 128/64/64 w4 s4": ({}, tail64(C(128, 64, 64, 4, 4, True))),
}


def timeit(fn, reps=8):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def main():
    torch.manual_seed(0)
    w = random_int4_experts(E, D, I, "cuda")
    w13, w2 = dequant_bf16(w, D, I)
    only = [p for p in os.environ.get("INT4_TILES_ONLY", "").split(",") if p]
    rows = []
    for T in [int(t) for t in os.environ.get("INT4_TILES_T", "8192,2048").split(",")]:
        x, ids, tw = moe_inputs(T, D, E, K, "cuda")
        base = fused_experts(x, w13, w2, tw, ids, 0)
        tb = timeit(lambda: fused_experts(x, w13, w2, tw, ids, 0))
        flops = 6.0 * T * K * D * I
        print(
            f"T={T} bf16 fused_experts {tb:.3f} ms {flops / tb / 1e9:.0f} TFLOP/s; INT4 defaults: "
            f"{gemm_config(T, K, E, D, I, torch.bfloat16)}",
            flush=True,
        )
        rows.append(dict(T=T, variant="bf16 fused_experts", ms=tb))
        for name, cs in VARIANTS.items():
            if only and not any(name.startswith(p) for p in only):
                continue
            cfg = dict(form="gemm") if cs is None else dict(form="gemm", gemm1=cs[0], gemm2=cs[1])
            try:
                err = rel(int4_fused_experts(x, *w, tw, ids, 0, config=cfg), base)
                ms = timeit(lambda cfg=cfg: int4_fused_experts(x, *w, tw, ids, 0, config=cfg))
            except Exception as e:  # a tile that does not compile on this GPU
                print(f"T={T} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            print(f"T={T} {name:60s} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s rel {err:.2e}", flush=True)
            rows.append(dict(T=T, variant=name, ms=ms, rel=err, config=cfg))
    save_json("int4_moe_tiles.json", rows)


if __name__ == "__main__":
    main()
