"""The INT4 MoE GEMV at one token, each launch's own time (torch.profiler over a CUDA graph of 48 calls with
rotating routings over 384 experts; PDL off, so no kernel's time holds its wait on the one before): the MoE-TP4
shard (7168 -> 512) with its default tiles and three alternatives, two split-K stand-ins for its gemv1 (the same
gemv1 bytes as 1,024 or 512 programs over a quarter / half of K: D 1792 / I 2048, D 3584 / I 1024), and the whole
Kimi-K2.5 expert. call_us: the call timed by events (kernels plus their gaps).

    PYTHONPATH=$PWD python benchmarks/int4_gemv_kernels.py      # JSON to $OUT/tp4_prof.json (default out/)
"""

import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

from mlaserve.kernel_config import KernelConfig
from mlaserve.kernels.int4_moe import int4_fused_experts
from tests.helpers.int4_ref import random_int4_experts

K, E = 8, 384
out = []


def run(name, D, I, cfg, w=None):
    torch.manual_seed(0)
    w = w or random_int4_experts(E, D, I, "cuda")
    ids = [torch.randperm(E, device="cuda")[:8].view(1, 8) for _ in range(48)]
    tw = torch.rand(1, K, device="cuda")
    x = torch.randn(1, D, device="cuda").to(torch.bfloat16)
    kc = KernelConfig(pdl=False)

    def f(i):
        return int4_fused_experts(x, *w, tw, ids[i % 48], 0, config=cfg, kernels=kc)

    for i in range(96):
        f(i)
    torch.cuda.synchronize()
    # graph of 48 calls (no host gaps)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(48):
            f(i)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            g.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ev.sort(key=lambda e: e.time_range.start)
    by = {}
    for e in ev:
        k = (
            "gemv1"
            if "gemv1" in e.name
            else "gemv2"
            if "gemv2" in e.name
            else "sum"
            if "sum" in e.name
            else e.name[:20]
        )
        by.setdefault(k, []).append((e.time_range.start, e.time_range.end))
    st = torch.cuda.Event(enable_timing=True)
    en = torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(10):
        g.replay()
    en.record()
    torch.cuda.synchronize()
    call = st.elapsed_time(en) / 480 * 1000
    g1 = sorted(b - a for a, b in by["gemv1"])
    g2 = sorted(b - a for a, b in by["gemv2"])
    span = sorted(b2 - a1 for (a1, _), (_, b2) in zip(by["gemv1"], by["gemv2"]))

    def med(v):
        return v[len(v) // 2]

    nb = 8 * (2 * I * (D // 8 * 4 + D // 32 * 2) + D * (I // 8 * 4 + I // 32 * 2))
    r = dict(
        name=name,
        D=D,
        I=I,
        cfg=str(cfg),
        call_us=call,
        gemv1_us=med(g1),
        gemv2_us=med(g2),
        span_us=med(span),
        TBps_call=nb / call / 1e6,
        TBps_span=nb / med(span) / 1e6,
        MB=nb / 1e6,
    )
    out.append(r)
    print(
        f"{name:34s} call {call:6.2f} us  gemv1 {med(g1):6.2f}  gemv2 {med(g2):6.2f}  span {med(span):6.2f}  "
        f"{r['TBps_call']:.2f} / {r['TBps_span']:.2f} TB/s  {nb / 1e6:.1f} MB",
        flush=True,
    )
    return w


w = run("tp4 default", 7168, 512, None)
run("tp4 mma MR2 WG4 r64", 7168, 512, dict(form="gemv_mma", mma1=dict(MR=2, WG=4, MUL=False, maxnreg=64)), w)
run("tp4 mma MR1 WG8 pf", 7168, 512, dict(form="gemv_mma", mma1=dict(MR=1, WG=8, MUL=False, PREFETCH=True)), w)
run("tp4 fma", 7168, 512, dict(form="gemv_fma"), w)
del w
torch.cuda.empty_cache()
run("proxy D1792 I2048 (split-K 4 gemv1)", 1792, 2048, None)
torch.cuda.empty_cache()
run("proxy D3584 I1024 (split-K 2 gemv1)", 3584, 1024, None)
torch.cuda.empty_cache()
run("kimi full", 7168, 2048, None)
os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "out"), "tp4_prof.json"), "w"), indent=1)
