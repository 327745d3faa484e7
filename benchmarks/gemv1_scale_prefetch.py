"""The INT4 MoE's tensor-core GEMV with gemv1's scale rows asked of L2 / L1 at the program's start (mma1 PFS 1 / 2)
and with gemv2's second trip by cp.async (mma2 NS 2), against the default, Kimi-K2.5's experts (7168 -> I, 8 of
384) at I = 512 / 1024 / 256 / 2048 (MoE-TP4 / TP2 / TP8 shards, whole experts), one and two tokens: each call a
CUDA graph of 48 calls over rotating routings (bench_util.graph_us), two rounds; outputs compared bit for bit.

    PYTHONPATH=$PWD python benchmarks/gemv1_scale_prefetch.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from benchmarks.bench_util import graph_us
from mlaserve.kernels.int4_moe import int4_fused_experts
from tests.helpers.int4_ref import random_int4_experts

D, K, E = 7168, 8, 384
V = {"default": None, "PFS1": {"mma1": {"PFS": 1}}, "PFS2": {"mma1": {"PFS": 2}}, "gemv2 NS2": {"mma2": {"NS": 2}}}
out = []
for I in [int(i) for i in os.environ.get("PFS_I", "512,1024,256,2048").split(",")]:
    torch.manual_seed(0)
    w = random_int4_experts(E, D, I, "cuda")
    nbytes = sum(t.numel() * t.element_size() for t in w) / E * K  # one token's 8 experts
    g = torch.Generator(device="cuda").manual_seed(1)
    for T in (1, 2):
        ids = [torch.rand(T, E, device="cuda", generator=g).topk(K, -1).indices for _ in range(48)]
        tw = torch.rand(T, K, device="cuda", generator=g)
        x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        ref = {}
        res = {"I": I, "T": T}
        for _round in range(2):
            for name, cfg in V.items():
                if name == "gemv2 NS2" and (T > 1 or I not in (512, 1024)):
                    continue
                o = int4_fused_experts(x, *w, tw, ids[5], 0, config=cfg)
                ref.setdefault("default", o)
                res[name + " same"] = bool(torch.equal(o, ref["default"]))
                us = graph_us(
                    lambda i, cfg=cfg, w=w: int4_fused_experts(x, *w, tw, ids[i % 48], 0, config=cfg),
                    range(48),
                    replays=7,
                )
                res.setdefault(name, []).append(round(us, 2))
        res["TB/s default (T=1 bytes)"] = round(nbytes / min(res["default"]) / 1e6, 3) if T == 1 else None
        print(json.dumps(res), flush=True)
        out.append(res)
    del w
    torch.cuda.empty_cache()
os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "out"), "gemv1_scale_prefetch.json"), "w"), indent=1)
