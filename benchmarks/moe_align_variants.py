"""moe_align's tiles and chunks at M1's MoE (64 routed experts + 2 fused shared, 6 + 2 slots a token), by tokens T:
microseconds a call inside a CUDA graph (16 routings in turn), every variant's layout checked equal to the first's.
Needs a GPU. Writes $OUT/moe_align_variants.json.

    PYTHONPATH=$PWD python benchmarks/moe_align_variants.py

The variants pin their parameters, so the comparison holds on any tree: "before" is the align before de58a5f (the
shared slots counted as two more experts, 128 one-hot lanes: one program up to 512 pairs, chunks of 256, tiles of
32 pairs); "default" is today's (shared slots placed, one program up to 128 pairs, then 64-pair chunks, tiles of 128).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks.*
from benchmarks.bench_util import graph_us, save_json  # noqa: E402
from mlaserve.kernels.moe_align import moe_align  # noqa: E402
from mlaserve.kernels.moe_config import moe_config  # noqa: E402

E, S, K, D, I = 64, 2, 6, 2048, 1408
VARIANTS = {
    "before": dict(fused_max=512, chunk=256, sub=32),
    "tiles 128": dict(fused_max=512, chunk=256, sub=128),
    "chunks 64": dict(fused_max=0, chunk=64, sub=32),
    "placed": dict(shared=S, fused_max=1024, chunk=512, sub=64),
    "placed, tiles 128": dict(shared=S, fused_max=1024, chunk=512, sub=128),
    "default": dict(shared=S),
}


def routing(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    routed = torch.rand(T, E, device="cuda", generator=g).topk(K, -1).indices
    return torch.cat([routed, torch.arange(E, E + S, device="cuda").expand(T, S)], 1).contiguous()


def main() -> None:
    rows = []
    for T in (16, 64, 512, 8192):
        bm = moe_config(T, K + S, E + S, D, I, torch.bfloat16)[0]["BLOCK_M"]
        items = [routing(T, s) for s in range(16)]
        ref = [moe_align(x, E + S, 0, bm, pdl=False, **VARIANTS["before"]) for x in items]
        line = f"T={T:5d} pairs={T * (K + S):6d} BLOCK_M={bm:3d}"
        for name, kw in VARIANTS.items():
            bad = 0
            for x, (rs, re, rn) in zip(items, ref):
                s, e, n = moe_align(x, E + S, 0, bm, pdl=False, **kw)
                m = int(rn)
                bad += int(
                    int(n) != m or not torch.equal(s[:m], rs[:m]) or not torch.equal(e[: m // bm], re[: m // bm])
                )
            us = graph_us(lambda x: moe_align(x, E + S, 0, bm, pdl=False, **kw), items)  # noqa: B023
            rows.append(dict(T=T, variant=name, us=us, layouts_differing=bad, block_m=bm))
            line += f" | {name} {us:.1f}{' LAYOUT DIFFERS' if bad else ''}"
        print(line, flush=True)
    save_json("moe_align_variants.json", rows)


if __name__ == "__main__":
    main()
