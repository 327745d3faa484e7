"""The fused MoE at prefill sizes (default M1's: 64 routed experts, top 6, hidden 2048, intermediate 1408; the
shared experts run apart above 32 tokens): tile variants of the two grouped GEMMs against the default, by tokens T.
Microseconds a call (a CUDA graph's replays), the weights' read rate (the distinct experts' bytes) and TFLOP/s;
every variant's output compared with the default's. Needs a GPU. Writes $OUT/moe_prefill_tiles.json.

    PYTHONPATH=$PWD python benchmarks/moe_prefill_tiles.py [--tokens 256,384,512,1024] [--shape D,I,E,K]

(--shape 7168,2048,256,8: DeepSeek-V3's experts in bf16; 7168,2048,384,8: Kimi-K2.5's.)

At a few hundred tokens nearly every expert is read and each gets tens of rows: the GEMMs stream the weights, so
the block of rows an expert (BLOCK_M) decides how often a weight tile is read and how many programs share the SMs.
The variants pin every parameter, so the comparison holds on any tree.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks.*
from benchmarks.bench_util import moe_inputs, rel, save_json  # noqa: E402
from mlaserve.kernels.fused_moe import fused_experts  # noqa: E402
from mlaserve.kernels.moe_config import moe_config  # noqa: E402

BF = torch.bfloat16


def tiles(bm, n1, k1, w1, s1, n2, k2, w2, s2, gm=8) -> dict:
    return dict(
        gemm1=dict(BLOCK_M=bm, BLOCK_N=n1, BLOCK_K=k1, GROUP_M=gm, num_warps=w1, num_stages=s1),
        gemm2=dict(BLOCK_M=bm, BLOCK_N=n2, BLOCK_K=k2, GROUP_M=gm, num_warps=w2, num_stages=s2),
    )


VARIANTS = {  # gemm1 / gemm2 BLOCK_N, then BLOCK_K, warps, stages; GROUP_M 8
    "default": None,
    "bm128 n128/256 w8 (65+ rows)": tiles(128, 128, 64, 8, 3, 256, 64, 8, 4),
    "bm128 n128/128 w8": tiles(128, 128, 64, 8, 3, 128, 64, 8, 3),
    "bm64 n128/128 w4 s4": tiles(64, 128, 64, 4, 4, 128, 64, 4, 4),
    "bm64 n128/256 w8 s3": tiles(64, 128, 64, 8, 3, 256, 64, 8, 3),
    "bm64 n64/128 k128 s3": tiles(64, 64, 128, 4, 3, 128, 128, 4, 3),
    "bm32 n128/128 k128 s3": tiles(32, 128, 128, 4, 3, 128, 128, 4, 3),
    "bm64 n64/128 (33-64 rows)": tiles(64, 64, 64, 4, 4, 128, 64, 4, 4),
    "bm32 n64/64 k128 G8": tiles(32, 64, 128, 4, 4, 64, 128, 4, 4),
    "bm32 n64/128 k128 G8": tiles(32, 64, 128, 4, 4, 128, 128, 4, 3),
    "bm16 n64/64 k128 G8": tiles(16, 64, 128, 4, 4, 64, 128, 4, 4),
    # the weight tiles by TMA (fused_moe's decode form) at prefill sizes
    "bm64 n64/128 TMA s4": dict(tiles(64, 64, 64, 4, 4, 128, 64, 4, 4), tma=True),
    "bm64 n64/128 k128 TMA s3": dict(tiles(64, 64, 128, 4, 3, 128, 128, 4, 3), tma=True),
    "bm128 n128/256 w8 TMA": dict(tiles(128, 128, 64, 8, 3, 256, 64, 8, 4), tma=True),
}


def main() -> None:
    from triton.testing import do_bench_cudagraph

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,384,512,1024")
    ap.add_argument("--shape", default="2048,1408,64,6", help="D,I,E,K (hidden, intermediate, experts, top-k)")
    a = ap.parse_args()
    D, I, E, K = (int(v) for v in a.shape.split(","))
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=BF) * D**-0.5  # made in bf16: no fp32 copy of the experts
    w2 = torch.randn(E, D, I, device="cuda", dtype=BF) * I**-0.5
    rows = []
    for T in map(int, a.tokens.split(",")):
        x, ids, w = moe_inputs(T, D, E, K, "cuda")
        n_exp = int(ids.unique().numel())
        ref = fused_experts(x, w13, w2, w, ids, 0)
        base = None
        for name, cfg in VARIANTS.items():
            try:
                out = fused_experts(x, w13, w2, w, ids, 0, config=cfg)
                err = rel(out, ref)
                fn = lambda: fused_experts(x, w13, w2, w, ids, 0, config=cfg)  # noqa: E731, B023
                ms = do_bench_cudagraph(fn, rep=40, return_mode="median")
            except Exception as e:  # a variant past the shared memory
                print(f"T={T} {name}: {type(e).__name__}: {str(e)[:100]}")
                continue
            base = base or ms
            tbs, tfs = n_exp * 3 * D * I * 2 / ms / 1e9, 6 * T * K * D * I / ms / 1e9
            rpe = T * K / E
            r = dict(T=T, shape=a.shape, rows_per_expert=rpe, variant=name, us=ms * 1e3, vs_default=ms / base)
            r.update(TBps=tbs, TFLOPs=tfs, rel_err=err)
            if cfg is None:
                r["default_tiles"] = moe_config(T, K, E, D, I, BF)
            rows.append(r)
            print(
                f"T={T:5d} ({rpe:5.1f} rows) {name:32s} {ms * 1e3:8.1f} us  x{ms / base:5.3f}  {tbs:5.2f} TB/s "
                f"{tfs:6.1f} TFLOP/s"
            )
    save_json("moe_prefill_tiles.json", rows)


if __name__ == "__main__":
    main()
