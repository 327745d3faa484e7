"""Deterministic mode's fused MoE (KernelConfig.moe_fixed_config: aligned blocks of 64 rows, BLOCK_K 64, at every
step) against other tiles at decode sizes, at Moonlight's experts: whether a tile gives the fixed config's bits
(every row of steps of 1 .. 300 tokens against a 1,024-token step's), and its time at 1 and 8 tokens, beside the
default kernels' (the grouped GEMV). A CUDA graph of calls over rotating routings.

    PYTHONPATH=$PWD python benchmarks/det_moe_tiles.py      # JSON to $OUT/det_moe_tiles.json
"""

import torch

from benchmarks.bench_util import graph_us, save_json
from mlaserve.kernel_config import KernelConfig
from mlaserve.kernels.fused_moe import fused_experts

E, D, I, K, T = 64, 2048, 1408, 6, 1024


def main():
    dev = "cuda"
    torch.manual_seed(0)
    det = KernelConfig().batch_invariant()
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, D, device=dev) / D**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, I, device=dev) / I**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
    wts = torch.rand(T, K, device=dev)
    base = det.moe_fixed_config()
    full = fused_experts(x, w13, w2, wts, ids, config=base, kernels=det)
    rows = []
    g = dict(GROUP_M=1, num_warps=4)
    variants = {"the mode's 64-row tiles": base}
    for bk in (64, 128):
        for tma, (s1, s2) in ((False, (3, 4)), (True, (2, 3))):
            variants[f"16 rows, BLOCK_K {bk}, N 32/64, {'TMA' if tma else 'pointers'}"] = dict(
                no_align=False, gemv=False, tma=tma, BLOCK_M=16,
                gemm1=dict(g, BLOCK_N=32, BLOCK_K=bk, num_stages=s1),
                gemm2=dict(g, BLOCK_N=64, BLOCK_K=bk, num_stages=s2),
            )  # fmt: skip
    routings = [torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(8)]) for _ in range(16)]
    for name, cfg in variants.items():
        same = {}
        try:
            for n in (1, 2, 3, 8, 17, 64, 300):
                got = fused_experts(x[:n], w13, w2, wts[:n], ids[:n], config=cfg, kernels=det)
                same[n] = bool(torch.equal(got, full[:n]))
            times = {
                n: graph_us(
                    lambda i, n=n, cfg=cfg: fused_experts(
                        x[:n], w13, w2, wts[:n], routings[i][:n], config=cfg, kernels=det
                    ),
                    range(16),
                )
                for n in (1, 8)
            }
        except Exception as ex:  # noqa: BLE001 (a tile that fails is reported)
            print(f"{name}: {type(ex).__name__}: {str(ex)[:200]}")
            continue
        rows.append(dict(variant=name, same_bits=same, us=times))
        print(
            f"{name:44s} same {all(same.values())} {same}  T=1 {times[1]:6.1f} us  T=8 {times[8]:6.1f} us", flush=True
        )
    dflt = KernelConfig()
    times = {
        n: graph_us(lambda i, n=n: fused_experts(x[:n], w13, w2, wts[:n], routings[i][:n], kernels=dflt), range(16))
        for n in (1, 8)
    }
    rows.append(dict(variant="default kernels", us=times))
    print(f"{'default kernels (grouped GEMV)':44s} T=1 {times[1]:6.1f} us  T=8 {times[8]:6.1f} us", flush=True)
    save_json("det_moe_tiles.json", rows)


if __name__ == "__main__":
    main()
