"""One bf16 `fused_experts` call with the tree's default tiles, timed, for A/Bs of source trees: M1's routed experts
(2048 -> 1408, 64 experts, top-6, random routing seeded by the token count), median of 8 calls, and a checksum
(sum |out|) that equal trees share bit for bit. The bf16 twin of int4_moe_call.py; run it from this checkout with
each tree on PYTHONPATH, rounds alternating:

    bash benchmarks/ab_trees.sh export base=REV new=REV
    for t in base new base new; do TREE=$t PYTHONPATH=ab/$t python benchmarks/moe_call.py; done

MOE_CALL_T: token counts (default 128,512,2048); MOE_CALL_SHAPE: D,I,E,K (7168,2048,256,8: DeepSeek-V3's experts
in bf16). Prints one JSON line a row; needs a GPU.
"""

from __future__ import annotations

import json
import os

import torch

from benchmarks.int4_moe_tiles import timeit
from mlaserve.kernels.fused_moe import fused_experts


def main() -> None:
    D, I, E, K = (int(v) for v in os.environ.get("MOE_CALL_SHAPE", "2048,1408,64,6").split(","))
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * I, D, device="cuda") / D**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, I, device="cuda") / I**0.5).to(torch.bfloat16)
    for T in [int(t) for t in os.environ.get("MOE_CALL_T", "128,512,2048").split(",")]:
        g = torch.Generator(device="cuda").manual_seed(T)
        ids = torch.rand(T, E, device="cuda", generator=g).topk(K, -1).indices
        tw = torch.rand(T, K, device="cuda", generator=g)
        x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        out = fused_experts(x, w13, w2, tw, ids, all_local=True)
        ms = timeit(lambda: fused_experts(x, w13, w2, tw, ids, all_local=True))
        row = dict(tree=os.environ.get("TREE", "?"), shape=[D, I, E, K], T=T, ms=ms)
        print(json.dumps(dict(row, checksum=float(out.float().abs().sum()))), flush=True)


if __name__ == "__main__":
    main()
