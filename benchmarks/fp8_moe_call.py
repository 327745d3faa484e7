"""One W8A8 `fp8_fused_experts` call with the tree's default tiles, timed, for A/Bs of source trees: DeepSeek-V3's
experts (7168 -> 2048, 256 experts, top-8, random routing seeded by the token count), median of 8 calls, each
GEMM's median time (torch.profiler; under PDL a kernel's duration includes its wait for the one before), and a
checksum (sum |out|) that equal trees share bit for bit. Run it from this checkout with another tree on PYTHONPATH:

    bash benchmarks/ab_trees.sh export base=REF new=REF
    for t in base new base new; do TREE=$t PYTHONPATH=ab/$t python benchmarks/fp8_moe_call.py; done

FP8_CALL_T: token counts (default 2048,8192). Prints one JSON line a row; needs a GPU.
"""

from __future__ import annotations

import json
import os

import torch

from benchmarks.int4_moe_tiles import timeit
from mlaserve.kernels.fp8_moe import fp8_fused_experts
from tests.helpers.fp8_checks import make_fp8_experts

D, I, E, K = 7168, 2048, 256, 8


def gemm_times(call, reps: int = 8) -> dict[str, float]:
    """Median ms a launch of each fp8 MoE GEMM over `reps` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    out = {}
    for name in ("gemm1", "gemm2"):
        ds = sorted(e.device_time for e in prof.events() if f"_fp8_moe_{name}_kernel" in e.name and e.device_time > 0)
        out[name] = ds[len(ds) // 2] / 1e3 if ds else None
    return out


def main() -> None:
    torch.manual_seed(0)
    w = make_fp8_experts("cuda", E=E, D=D, I=I)
    for T in [int(t) for t in os.environ.get("FP8_CALL_T", "2048,8192").split(",")]:
        g = torch.Generator(device="cuda").manual_seed(T)
        ids = torch.rand(T, E, device="cuda", generator=g).topk(K, -1).indices
        tw = torch.rand(T, K, device="cuda", generator=g)
        x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        cfg = dict(a8=True, gemv=False)
        out = fp8_fused_experts(x, *w, tw, ids, config=cfg)
        ms = timeit(lambda: fp8_fused_experts(x, *w, tw, ids, config=cfg))
        kernels = gemm_times(lambda: fp8_fused_experts(x, *w, tw, ids, config=cfg))
        row = dict(tree=os.environ.get("TREE", "?"), T=T, ms=ms, **{f"{k}_ms": v for k, v in kernels.items()})
        print(json.dumps(dict(row, checksum=float(out.float().abs().sum()))), flush=True)


if __name__ == "__main__":
    main()
