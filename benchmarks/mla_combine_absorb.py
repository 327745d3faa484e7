"""MLA decode with the value absorption inside its combine (mla_decode's `absorb`) against the split, the combine and
the model's own absorption after it (head_gemv at 1-2 tokens, torch.bmm above): microseconds a layer, by heads,
tokens a request, batch and context. Each call rotates over 8 layers' caches and w_vc (CUDA graph, PDL on both
sides); the outputs compared. Needs a GPU. Writes $OUT/mla_combine_absorb.json.

    PYTHONPATH=$PWD python benchmarks/mla_combine_absorb.py [--heads 16,64] [--batches 1,8,32] [--contexts 512,8192]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks.*
from benchmarks.bench_util import graph_us, rel, save_json  # noqa: E402
from mlaserve.kernels.head_gemv import head_gemv, head_gemv_serves  # noqa: E402
from mlaserve.kernels.mla_decode import mla_decode  # noqa: E402
from tests.helpers.kernel_checks import make_paged  # noqa: E402

BF = torch.bfloat16
R, P, N, V, PAGE, LAYERS = 512, 64, 128, 128, 64, 8
FUSED = {  # the fused kernel's output columns a program and warps (the default: mla_combine.ABSORB_BLOCK_V, 4)
    "fused": None,
    "v64w8": dict(ABSORB_BLOCK_V=64, ABSORB_WARPS=8),
    "v128w8": dict(ABSORB_BLOCK_V=128, ABSORB_WARPS=8),
    "v16w2": dict(ABSORB_BLOCK_V=16, ABSORB_WARPS=2),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16,64")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--q-lens", default="1,2")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for H in map(int, a.heads.split(",")):
        w = [(torch.randn(H * (N + V), R, device="cuda") / R**0.5).to(BF) for _ in range(LAYERS)]
        w_vc = [x.view(H, N + V, R)[:, N:].transpose(1, 2) for x in w]  # [H, R, V], as the model's view
        for ql in map(int, a.q_lens.split(",")):
            for B in map(int, a.batches.split(",")):
                for L in map(int, a.contexts.split(",")):
                    T = B * ql
                    caches = [make_paged([L + ql] * B, PAGE, R + P, BF, "cuda") for _ in range(LAYERS)]
                    q = (0.3 * torch.randn(T, H, R + P, device="cuda")).to(BF)
                    o_lat = torch.empty(T, H, R, device="cuda", dtype=BF)
                    out_a, out_b = (torch.empty(T, H * V, device="cuda", dtype=BF) for _ in range(2))
                    scale = (N + P) ** -0.5

                    def apart(i):
                        kv, table, lens = caches[i]
                        mla_decode(q, kv, table, lens, ql, scale, o_lat)
                        y = out_a.view(T, H, V)
                        if head_gemv_serves(o_lat, w_vc[i]):
                            head_gemv(o_lat, w_vc[i], y)
                        else:
                            torch.bmm(o_lat.transpose(0, 1), w_vc[i], out=y.transpose(0, 1))

                    def fused(i, cfg=None):
                        kv, table, lens = caches[i]
                        mla_decode(q, kv, table, lens, ql, scale, out_b.view(T, H, V), config=cfg, absorb=w_vc[i])

                    us_a = graph_us(apart, range(LAYERS))
                    r = dict(H=H, q_len=ql, B=B, ctx=L, apart_us=us_a)
                    line = f"H={H:3d} q_len={ql} B={B:3d} ctx={L:5d}: apart {us_a:6.2f} us"
                    for name, cfg in FUSED.items():
                        us_b = graph_us(lambda i, c=cfg: fused(i, c), range(LAYERS))
                        apart(LAYERS - 1)
                        fused(LAYERS - 1, cfg)
                        r[name] = dict(us=us_b, saved_us=us_a - us_b, rel=rel(out_b, out_a))
                        line += f", {name} {us_b:6.2f} ({us_a - us_b:+.2f}, rel {r[name]['rel']:.0e})"
                    rows.append(r)
                    print(line, flush=True)
        torch.cuda.empty_cache()
    save_json("mla_combine_absorb.json", rows)


if __name__ == "__main__":
    main()
