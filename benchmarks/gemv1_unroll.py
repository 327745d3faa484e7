"""The tensor-core INT4 gemv1 of one-token steps on the MoE-TP2 / TP4 / TP8 shards with K's trips unrolled at
compile time (int4_mma._mma_dot's NGC: ptxas may then issue later trips' loads early, where a runtime loop has its
next-trip loads placed at the end of the loop body), against the runtime loop, at several register budgets.

A: gemv1 alone (PDL off; a CUDA graph of 48 launches with rotating routings over 384 experts), its output compared
bit for bit with the runtime loop's. B: the whole `int4_fused_experts` call (both GEMVs and the top-k sum, PDL as
the engine runs it): the default config (unrolled) against the runtime loop it replaced and the other register
budget, rounds alternating; "same": the output equals the default's bit for bit.

    PYTHONPATH=$PWD python benchmarks/gemv1_unroll.py      # JSON to $OUT/gemv1_unroll.json
"""

import torch

from benchmarks.bench_util import graph_us, save_json
from mlaserve.kernels.int4_mma_gemv import _int4_mma_gemv1_kernel
from mlaserve.kernels.int4_moe import int4_fused_experts
from tests.helpers.int4_ref import random_int4_experts

E, K, D = 384, 8, 7168
SHAPES = {"tp2": 1024, "tp4": 512, "tp8": 256}


def shard_inputs(I: int, dev):
    """A one-token step on a shard of intermediate size I, seeded: the experts (random_int4_experts), the bytes
    gemv1 and the whole call read, 48 routings (8 of the 384 experts each), x [1, D] bf16 and its top-k weights."""
    torch.manual_seed(0)
    w = random_int4_experts(E, D, I, dev)
    w13, s13 = w[0], w[1]
    b1 = (w13[0].numel() * 4 + s13[0].numel() * 2) * K
    ball = sum(t[0].numel() * t.element_size() for t in w) * K
    ids = [torch.randperm(E, device=dev)[:K].view(1, K) for _ in range(48)]
    x = torch.randn(1, D, device=dev).to(torch.bfloat16)
    return w, b1, ball, ids, x, torch.rand(1, K, device=dev)


def main():
    dev = "cuda"
    rows = []
    for shape, I in SHAPES.items():
        w, b1, ball, ids, x, tw = shard_inputs(I, dev)
        w13, s13 = w[0], w[1]
        x32 = x.view(torch.int32)
        ng = D // 32

        def g1(i, h, ngc, cap):
            _int4_mma_gemv1_kernel[(K * (I // 16),)](
                x32, w13, s13, h, ids[i % 48], I, ng, K, x32.stride(0), w13.stride(0), w13.stride(1),
                s13.stride(0), s13.stride(1) // 4, h.stride(0), 0, E, TOPK=K, TKP=0, MR=2, WG=8, EVEN=True,
                PREFETCH=True, MUL=False, NS=1, PDL=False, NGC=ngc, num_warps=8, num_stages=1, maxnreg=cap,
            )  # fmt: skip

        ref = torch.full((K, I), float("nan"), dtype=torch.bfloat16, device=dev)
        g1(0, ref, 0, None)
        var_a = [("runtime loop", 0, None)] + [(f"unrolled, maxnreg {c}", ng, c) for c in (128, 168)]
        # the default (K's trips unrolled; MoE-TP8 on the tensor cores) against the runtime loop it replaced (TP8:
        # the FMA GEMV) and the other register budget
        before = dict(form="gemv_fma") if I < 512 else dict(mma1=dict(UNROLL=False, PREFETCH=True, maxnreg=None))
        other = 128 if I < 512 else 168
        var_b = [
            ("default", {}),
            ("before (runtime loop; TP8: FMA)", before),
            ("MMA, runtime loop", dict(form="gemv_mma", mma1=dict(UNROLL=False, PREFETCH=True, maxnreg=None))),
            (f"MMA, unrolled, maxnreg {other}", dict(form="gemv_mma", mma1=dict(maxnreg=other))),
        ]
        outs = {}
        for rnd in range(2):
            for name, ngc, cap in var_a:
                h = torch.full((K, I), float("nan"), dtype=torch.bfloat16, device=dev)
                g1(0, h, ngc, cap)
                torch.cuda.synchronize()
                same = bool(torch.equal(h, ref))
                us = graph_us(lambda i, h=h, ngc=ngc, cap=cap: g1(i, h, ngc, cap), range(48), replays=7)
                rows.append(dict(shape=shape, part="gemv1", name=name, us=us, TBps=b1 / us / 1e6, same_bits=same))
                print(f"{shape} r{rnd} gemv1 {name:34s} {us:7.2f} us {b1 / us / 1e6:.2f} TB/s same {same}", flush=True)
            for name, cfg in var_b:
                out = int4_fused_experts(x, *w, tw, ids[0], 0, config=cfg)
                torch.cuda.synchronize()
                outs.setdefault(name, out)
                same = bool(torch.equal(out, outs["default"]))
                us = graph_us(
                    lambda i, cfg=cfg: int4_fused_experts(x, *w, tw, ids[i % 48], 0, config=cfg), range(48), replays=7
                )
                rows.append(dict(shape=shape, part="call", name=name, us=us, TBps=ball / us / 1e6, same_bits=same))
                print(
                    f"{shape} r{rnd} call  {name:34s} {us:7.2f} us {ball / us / 1e6:.2f} TB/s same {same}", flush=True
                )
    save_json("gemv1_unroll.json", rows)


if __name__ == "__main__":
    main()
