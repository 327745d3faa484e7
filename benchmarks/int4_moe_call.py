"""One `int4_fused_experts` call with the tree's default tiles, timed, for A/Bs of source trees: Kimi-K2.5's experts
(7168 -> I, 384 experts, top-8, random routing seeded by the token count), median of 8 calls, and a checksum
(sum |out|) that equal trees share bit for bit. Run it from this checkout with another tree on PYTHONPATH:

    bash benchmarks/ab_trees.sh export base=191a556 even=4d1c0a0
    for t in base even base even; do TREE=$t PYTHONPATH=ab/$t python benchmarks/int4_moe_call.py; done

INT4_CALL_T: token counts (default 512,2048,8192); INT4_CALL_I: the intermediate size (2048; MoE-TP4's shard 512,
TP8's 256); INT4_CALL_OLD_SMALL=1 adds the untransposed tiles used up to 24 rows an expert before d7b3f0d.
Prints one JSON line a row; needs a GPU.
"""

from __future__ import annotations

import json
import os

import torch

from benchmarks.int4_moe_tiles import timeit
from mlaserve.kernels.int4_moe import int4_fused_experts
from tests.helpers.int4_ref import random_int4_experts

D, E, K = 7168, 384, 8


def main() -> None:
    I = int(os.environ.get("INT4_CALL_I", "2048"))
    torch.manual_seed(0)
    w = random_int4_experts(E, D, I, "cuda")
    for T in [int(t) for t in os.environ.get("INT4_CALL_T", "512,2048,8192").split(",")]:
        g = torch.Generator(device="cuda").manual_seed(T)
        ids = torch.rand(T, E, device="cuda", generator=g).topk(K, -1).indices
        tw = torch.rand(T, K, device="cuda", generator=g)
        x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        configs = {"default": None}
        if os.environ.get("INT4_CALL_OLD_SMALL") == "1":
            old = dict(BLOCK_M=16 if T * K / E <= 8 else 32, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4)
            old = dict(old, num_stages=3, TRANS=False)  # TRANS set: a config merges into the defaults
            configs["old small-row tiles"] = dict(form="gemm", gemm1=old, gemm2=old)
        for name, cfg in configs.items():
            out = int4_fused_experts(x, *w, tw, ids, 0, config=cfg)
            ms = timeit(lambda cfg=cfg: int4_fused_experts(x, *w, tw, ids, 0, config=cfg))
            row = dict(tree=os.environ.get("TREE", "?"), I=I, T=T, tiles=name, ms=ms)
            print(json.dumps(dict(row, checksum=float(out.float().abs().sum()))), flush=True)


if __name__ == "__main__":
    main()
