"""INT4 MoE GEMV on a Kimi-K2.5 EP8 rank (48 of 384 whole experts: D 7168, I 2048) at decode and verify steps
(T = 1, 2 tokens, top-8): one `int4_fused_experts` call's time against how many of the step's T*8 pairs the rank
owns, and the time a step waits for its busiest rank under uniform routing.

Each owned count k: 48 routings captured in one CUDA graph (PDL as the engine runs it), each with k pairs on k
distinct local experts at random positions and the rest on other ranks' experts. "Busiest rank": the expected
call time of the rank that owns the most pairs, E[t(max owned)], with P(max owned = k) drawn by Monte Carlo over
uniform top-8 routings (k outside the timed set: the next timed k up). "default": the call as the layer makes it
(num_experts=384: tiles for the pairs the rank is expected to own); "before": without the expert count (tiles
for all the step's pairs local). "same": the output equals the default's bit for bit; "err": max |out - default|
/ max |default|.

    PYTHONPATH=$PWD python benchmarks/int4_ep_owned.py       # JSON to $OUT/int4_ep_owned.json
"""

import torch

from benchmarks.bench_util import graph_us, save_json
from mlaserve.kernels.int4_moe import int4_fused_experts
from tests.helpers.int4_ref import random_int4_experts

N_EXPERTS, EP, K, D, I = 384, 8, 8, 7168, 2048
E = N_EXPERTS // EP
OWNED = {1: [0, 1, 2, 3, 4, 5, 8], 2: [0, 1, 2, 3, 4, 5, 6, 8, 16]}


def variants():
    """(label, config, num_experts) per timed choice; config None: the default tiles. "before": the default tiles
    without the expert count, sized as if all the step's pairs were local (and pairing by 48 experts)."""
    return [
        ("default", None, N_EXPERTS),
        ("before", None, 0),
        ("gemv2 MR 1 WG 4", dict(form="gemv_mma", mma2=dict(MR=1, WG=4)), N_EXPERTS),
        ("FMA", dict(form="gemv_fma"), N_EXPERTS),
    ]


def routings(T: int, k: int, dev, n: int = 48):
    """n routings [T, K] (int32) with k pairs on k distinct local experts (ids 0..E-1), the rest off the rank."""
    g = torch.Generator().manual_seed(1000 * T + k)
    out = []
    for _ in range(n):
        local = torch.randperm(E, generator=g)[:k]
        ids = torch.empty(T, K, dtype=torch.int64)
        slots = torch.randperm(T * K, generator=g)[:k]
        own = torch.zeros(T * K, dtype=torch.bool)
        own[slots] = True
        for t in range(T):
            row = own[t * K : (t + 1) * K]
            remote = E + torch.randperm(N_EXPERTS - E, generator=g)[: K - int(row.sum())]
            ids[t, row] = local[: int(row.sum())]
            local = local[int(row.sum()) :]
            ids[t, ~row] = remote
        out.append(ids.to(torch.int32).to(dev))
    return out


def busiest(T: int, samples: int = 100_000) -> dict[int, float]:
    """P(max over the EP ranks of the pairs a rank owns = k) for T tokens of uniform top-K routing."""
    g = torch.Generator().manual_seed(T)
    ids = torch.rand(samples, T, N_EXPERTS, generator=g).argsort(-1)[..., :K]  # K distinct experts a token
    per_rank = torch.nn.functional.one_hot(ids // E, EP).sum((1, 2))  # [samples, EP]
    mx = per_rank.max(-1).values
    return {int(k): float((mx == k).float().mean()) for k in mx.unique()}


def main():
    dev = "cuda"
    torch.manual_seed(0)
    w = random_int4_experts(E, D, I, dev)
    per_expert = sum(t[0].numel() * t.element_size() for t in w)
    rows, summary = [], []
    for T in (1, 2):
        x = torch.randn(T, D, device=dev).to(torch.bfloat16)
        tw = torch.rand(T, K, device=dev)
        times = {}
        for k in OWNED[T]:
            ids = routings(T, k, dev)
            ref = None
            for rnd in range(2):
                for lab, cfg, n in variants():
                    call = lambda i, cfg=cfg, n=n: int4_fused_experts(  # noqa: E731
                        x, *w, tw, ids[i], 0, all_local=False, config=cfg, num_experts=n
                    )
                    out = call(0)
                    torch.cuda.synchronize()
                    ref = out if ref is None else ref
                    same = bool(torch.equal(out, ref))
                    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
                    us = graph_us(call, range(48), 7)
                    tb = k * per_expert / us / 1e6
                    times.setdefault(lab, {}).setdefault(k, []).append(us)
                    rows.append(dict(T=T, owned=k, variant=lab, round=rnd, us=us, TBps=tb, same_bits=same, err=err))
                    print(f"T{T} owned {k:2d} r{rnd} {lab:16s} {us:7.2f} us {tb:.2f} TB/s same {same} err {err:.1e}",
                          flush=True)  # fmt: skip
        p = busiest(T)
        print(f"T{T} P(max owned = k): " + ", ".join(f"{k}: {v:.3f}" for k, v in sorted(p.items())))
        for lab, by_k in times.items():
            best = {k: min(v) for k, v in by_k.items()}
            ks = sorted(best)
            expect = sum(pk * best[next((j for j in ks if j >= k), ks[-1])] for k, pk in p.items())
            summary.append(dict(T=T, variant=lab, busiest_us=expect, by_owned=best, p_max_owned=p))
            print(f"T{T} {lab:16s} busiest rank {expect:7.2f} us | " + " ".join(f"{k}:{best[k]:.1f}" for k in ks))
    save_json("int4_ep_owned.json", dict(rows=rows, summary=summary))


if __name__ == "__main__":
    main()
