"""INT4 tensor-core GEMV: pairs of one expert read together (pairing, `_partner`) against unpaired, as a function
of how many of a step's pairs share an expert. Kimi-K2.5's whole experts (D 7168, I 2048, 384 local, top-8), steps
of T = 2, 4, 8, 16 tokens, each token's 8 experts drawn uniformly from a window of n experts (n = 384: uniform
routing over all of them; smaller n: more sharing); 48 routings a case, each at its own window offset so the calls
rotate over weights, captured in one CUDA graph (benchmarks/bench_util.graph_us).

"sharing": 1 - distinct experts / pairs, the mean over the case's routings (what pair_worthwhile predicts for
uniform routing over n). Variants: "paired" (every step paired, PAIR_MIN_SHARED set to 0 for the call), "unpaired"
(config pair=False), "fma" (the FMA GEMV). Outputs agree within bf16 summation order (printed: err against paired).

    PYTHONPATH=$PWD python benchmarks/int4_pair_sharing.py      # JSON to $OUT/int4_pair_sharing.json
"""

import torch

from benchmarks.bench_util import graph_us, save_json
from mlaserve.kernels import int4_mma_run
from mlaserve.kernels.int4_moe import int4_fused_experts
from tests.helpers.int4_ref import random_int4_experts

E, K, D, I = 384, 8, 7168, 2048
STEPS = (2, 4, 8, 16)
WINDOWS = (384, 128, 64, 32, 16)


def routings(T: int, n: int, dev, count: int = 48) -> tuple[list[torch.Tensor], float]:
    """count routings [T, K] (int32), each token's K distinct experts uniform over a window of n experts at a random
    offset; and the mean share of the pairs whose expert another pair of the step also took."""
    g = torch.Generator().manual_seed(100 * T + n)
    out, shared = [], []
    for _ in range(count):
        base = int(torch.randint(0, E - n + 1, (1,), generator=g))
        ids = torch.stack([base + torch.randperm(n, generator=g)[:K] for _ in range(T)])
        shared.append(1.0 - ids.unique().numel() / ids.numel())
        out.append(ids.to(torch.int32).to(dev))
    return out, sum(shared) / len(shared)


def main():
    dev = "cuda"
    torch.manual_seed(0)
    w = random_int4_experts(E, D, I, dev)
    rows = []
    variants = {
        "paired": dict(form="gemv_mma"),
        "unpaired": dict(form="gemv_mma", pair=False),
        "fma": dict(form="gemv_fma"),
    }
    keep = int4_mma_run.PAIR_MIN_SHARED
    print(f"{'T':>3} {'n':>4} {'sharing':>8} | " + " ".join(f"{v:>10}" for v in variants) + " | paired/unpaired")
    for T in STEPS:
        x = torch.randn(T, D, device=dev).to(torch.bfloat16)
        tw = torch.rand(T, K, device=dev)
        for n in WINDOWS:
            ids, sharing = routings(T, n, dev)
            us, ref = {}, None
            for lab, cfg in variants.items():
                int4_mma_run.PAIR_MIN_SHARED = 0.0 if lab == "paired" else keep
                try:
                    call = lambda i, cfg=cfg: int4_fused_experts(x, *w, tw, ids[i], 0, config=cfg)  # noqa: E731
                    out = call(0)
                    ref = out if ref is None else ref
                    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
                    us[lab] = graph_us(call, range(len(ids)), 7)
                finally:
                    int4_mma_run.PAIR_MIN_SHARED = keep
                rows.append(dict(T=T, window=n, sharing=sharing, variant=lab, us=us[lab], err=err))
            ratio = us["paired"] / us["unpaired"]
            print(f"{T:3d} {n:4d} {sharing:8.3f} | " + " ".join(f"{us[v]:10.1f}" for v in variants) + f" | {ratio:.3f}")
    save_json("int4_pair_sharing.json", dict(rows=rows, pair_min_shared=keep))


if __name__ == "__main__":
    main()
