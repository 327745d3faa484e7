"""The INT4 MoE's GEMV-form calls (`int4_fused_experts` with the tree's default tiles, both GEMVs and the top-k sum,
PDL as the engine runs it) at decode-sized steps, for A/Bs of source trees: each row a CUDA graph of 48 calls over
rotating random routings (weights read from HBM, not L2), and a checksum (sum |out| of the first call) that equal
trees share bit for bit. Run it from this checkout with each tree on PYTHONPATH, rounds alternating:

    bash benchmarks/ab_trees.sh export base=REV new=REV
    for t in base new base new; do TREE=$t PYTHONPATH=ab/$t python benchmarks/int4_gemv_ab.py; done

Rows: Kimi-K2.5's experts (7168 -> 2048, 384 experts, top-8) at 1 and 2 tokens; the MoE-TP2 / TP4 / TP8 shards
(I = 1024 / 512 / 256) at one token; an EP8 rank (48 local experts) whose 8 picks are all local. Prints one JSON
line a row (bytes: the packed words and scales of the experts the step reads); needs a GPU.
"""

from __future__ import annotations

import json
import os

import torch

from benchmarks.bench_util import graph_us
from mlaserve.kernels.int4_moe import int4_fused_experts
from tests.helpers.int4_ref import random_int4_experts

D, K = 7168, 8
ROWS = [("kimi", 2048, 384, 1), ("kimi", 2048, 384, 2), ("tp2", 1024, 384, 1), ("tp4", 512, 384, 1)]
ROWS += [("tp8", 256, 384, 1), ("ep8 busy", 2048, 48, 1)]


def main() -> None:
    weights = {}
    for name, I, E, T in ROWS:
        torch.manual_seed(0)
        if (I, E) not in weights:
            weights = {(I, E): random_int4_experts(E, D, I, "cuda")}
        w = weights[(I, E)]
        g = torch.Generator(device="cuda").manual_seed(T)
        ids = [torch.rand(T, E, device="cuda", generator=g).topk(K, -1).indices for _ in range(48)]
        tw = torch.rand(T, K, device="cuda", generator=g)
        x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        out = int4_fused_experts(x, *w, tw, ids[0], 0)
        us = graph_us(lambda i: int4_fused_experts(x, *w, tw, ids[i % 48], 0), range(48), replays=7)
        per_expert = sum(t[0].numel() * t.element_size() for t in w)
        nbytes = sum(len(set(i.reshape(-1).tolist())) for i in ids) / len(ids) * per_expert
        row = dict(tree=os.environ.get("TREE", "?"), shape=name, I=I, E=E, T=T, us=us, TBps=nbytes / us / 1e6)
        print(json.dumps(dict(row, checksum=float(out.float().abs().sum()))), flush=True)


if __name__ == "__main__":
    main()
