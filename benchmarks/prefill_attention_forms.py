"""MLA's prefill attention, the Triton kernel against the Gluon kernel (kernels/prefill_attention_gluon.py) on one
GPU: one request of T tokens (q = k, causal) at each model's head count, both kernels in the same process, rounds
alternating (the best of 3 medians of CUDA-graph replays), outputs compared bit for bit.

    PYTHONPATH=$PWD python benchmarks/prefill_attention_forms.py     # JSON to $OUT/prefill_attention_forms.json

Heads: DeepSeek-V3 128, Kimi-K2.5 64, Moonlight (M1) 16. FLOPs count the causal half: 2 * H * (192 + 128) *
T (T + 1) / 2.
"""

import json
import os
import sys

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from mlaserve.kernels.prefill_attention import prefill_attention_mla  # noqa: E402
from mlaserve.kernels.prefill_attention_gluon import prefill_attention_mla_gluon, supported  # noqa: E402

SHAPES = [(128, 8192), (64, 8192), (16, 8192), (128, 2048)]  # (heads, tokens)


def main():
    dev, rows = "cuda", []
    for H, T in SHAPES:
        g = torch.Generator(device=dev).manual_seed(H + T)
        q = torch.randn(T, H, 192, device=dev, generator=g).to(torch.bfloat16)
        kv = torch.randn(T, H, 256, device=dev, generator=g).to(torch.bfloat16)  # [k_nope | v] as kv_b_proj's out
        latent = torch.randn(T, 576, device=dev, generator=g).to(torch.bfloat16)  # k_rope: its last 64 columns
        k_nope, k_rope, v = kv[..., :128], latent[:, 512:], kv[..., 128:]
        cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
        scale = 192**-0.5
        flops = 2.0 * H * 320 * T * (T + 1) / 2
        outs = {k: torch.full((T, H, 128), float("nan"), device=dev, dtype=torch.bfloat16) for k in ("triton", "gluon")}
        assert supported(q, k_nope, k_rope, v, outs["gluon"])
        fns = {
            "triton": lambda: prefill_attention_mla(q, k_nope, k_rope, v, cu, cu, scale, outs["triton"], T),
            "gluon": lambda: prefill_attention_mla_gluon(q, k_nope, k_rope, v, cu, cu, scale, outs["gluon"], T),
        }
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        same = torch.equal(outs["triton"], outs["gluon"])
        times = {k: [] for k in fns}
        for _ in range(3):
            for k, f in fns.items():
                times[k].append(do_bench_cudagraph(f, rep=40, return_mode="median"))
        for k in fns:
            ms = min(times[k])
            tf = flops / ms / 1e9
            rows.append(dict(heads=H, tokens=T, kernel=k, ms=ms, tflops=tf, rounds=times[k], same_bits=same))
            print(f"H={H:4d} T={T:5d} {k:7s} {ms:7.3f} ms {tf:5.0f} TFLOP/s  same bits: {same}", flush=True)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    with open(os.path.join(out, "prefill_attention_forms.json"), "w") as f:
        json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
