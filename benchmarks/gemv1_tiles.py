"""The tensor-core INT4 gemv1 of one-token steps on the MoE-TP shards, K's trips unrolled: its tiles (MR gate rows
x 8 a program, WG warps) and register caps. The default is MR 1, WG 8, 128 registers (int4_mma_run.mma_config); it
was MR 2 (128 registers at TP2 / TP4, 168 at TP8), the first variant.

A: gemv1 alone (PDL off; a CUDA graph of 48 launches with rotating routings over 384 experts), its output compared
bit for bit with the first variant's. B: the whole `int4_fused_experts` call (PDL as the engine runs it) for each
variant, rounds alternating; "same": the output equals the first variant's bit for bit.

    PYTHONPATH=$PWD python benchmarks/gemv1_tiles.py            # JSON to $OUT/gemv1_tiles.json
    PYTHONPATH=$PWD python benchmarks/gemv1_tiles.py --compile  # no GPU: registers / spills per variant (sm_90)
"""

import sys

import torch

from benchmarks.gemv1_unroll import D, E, K, shard_inputs

SHAPES = {"tp4": 512, "tp2": 1024, "tp8": 256}
# (MR, WG, maxnreg) of gemv1: the tiles before (TP2 / TP4; TP8's are the second), the default, others
VARIANTS = [
    (2, 8, 128),
    (2, 8, 168),
    (1, 8, 128),
    (1, 8, 80),
    (1, 8, 72),
    (1, 8, 64),
    (2, 8, 80),
    (2, 8, 64),
]
# gemv2 tiles tried with the gemv1 variant MR 1, WG 8, 64 registers (None: the default)
GEMV2 = [dict(MR=1, WG=2, maxnreg=64), dict(MR=1, WG=4, maxnreg=64)]


def calls():
    """(label, config) of every timed call: each gemv1 variant with the default gemv2, then GEMV2's tiles."""

    def c1(mr, wg, cap, unroll=True):
        return dict(MR=mr, WG=wg, maxnreg=cap, UNROLL=unroll)

    out = [(f"MR{mr} WG{wg} cap{cap}", dict(form="gemv_mma", mma1=c1(mr, wg, cap))) for mr, wg, cap in VARIANTS]
    out.append(("MR1 WG8 cap64, runtime loop", dict(form="gemv_mma", mma1=c1(1, 8, 64, False))))
    for ns in (2, 3, 4):  # the runtime loop with cp.async stages (shared memory) ahead
        out.append((f"MR1 WG8 cap128, loop NS{ns}", dict(form="gemv_mma", mma1=dict(c1(1, 8, 128, False), NS=ns))))
    out.append(("MR1 WG8 cap128, loop PREFETCH", dict(form="gemv_mma", mma1=dict(c1(1, 8, 128, False), PREFETCH=True))))
    for c2 in GEMV2:
        lab = "gemv2 " + " ".join(f"{k}{v}" for k, v in c2.items())
        out.append((f"MR1 WG8 cap64, {lab}", dict(form="gemv_mma", mma1=c1(1, 8, 64), mma2=c2)))
    return out


def launch(x32, w13, s13, h, ids, I, mr, wg, cap):
    from mlaserve.kernels.int4_mma_gemv import _int4_mma_gemv1_kernel

    ng = D // 32
    return _int4_mma_gemv1_kernel[(K * (I // (8 * mr)),)](
        x32, w13, s13, h, ids, I, ng, K, x32.stride(0), w13.stride(0), w13.stride(1),
        s13.stride(0), s13.stride(1) // 4, h.stride(0), 0, E, TOPK=K, TKP=0, MR=mr, WG=wg, EVEN=True,
        PREFETCH=False, MUL=False, NS=1, PDL=False, NGC=ng, num_warps=wg, num_stages=1, maxnreg=cap,
    )  # fmt: skip


def compile_only():
    from benchmarks import compile_check as cc

    cc.install()
    for shape, I in SHAPES.items():
        for mr, wg, cap in VARIANTS:
            x32 = torch.empty(1, D // 2, dtype=torch.int32)
            w13 = cc.big(E, 2 * I, D // 8, dtype=torch.int32)
            s13 = cc.big(E, 2 * I, D // 32)
            h = torch.empty(K, I, dtype=torch.bfloat16)
            k = launch(x32, w13, s13, h, torch.zeros(1, K, dtype=torch.int64), I, mr, wg, cap)
            regs, spills = cc._ptxas_usage(k.asm["ptx"])
            print(f"{shape} MR{mr} WG{wg} cap{cap}: regs {regs} spills {spills}", flush=True)
        from mlaserve.kernels.int4_moe import int4_fused_experts

        w = (cc.big(E, 2 * I, D // 8, dtype=torch.int32), cc.big(E, 2 * I, D // 32))
        w = (*w, cc.big(E, D, I // 8, dtype=torch.int32), cc.big(E, D, I // 32))
        for lab, cfg in calls()[len(VARIANTS) :]:
            cc.RESULTS.clear()
            x = torch.empty(1, D, dtype=torch.bfloat16)
            int4_fused_experts(x, *w, torch.empty(1, K), torch.zeros(1, K, dtype=torch.int64), 0, config=cfg)
            print(
                shape,
                lab,
                [(r["name"], r["regs"], r["spills"], r["pipe"], r["shared"]) for r in cc.RESULTS],
                flush=True,
            )


def main():
    from benchmarks.bench_util import graph_us, save_json
    from mlaserve.kernels.int4_moe import int4_fused_experts

    dev = "cuda"
    rows = []
    for shape, I in SHAPES.items():
        w, b1, ball, ids, x, tw = shard_inputs(I, dev)
        w13, s13 = w[0], w[1]
        x32 = x.view(torch.int32)
        ref = torch.full((K, I), float("nan"), dtype=torch.bfloat16, device=dev)
        launch(x32, w13, s13, ref, ids[0], I, *VARIANTS[0])
        a = {}
        for rnd in range(2):
            for mr, wg, cap in VARIANTS:
                h = torch.full((K, I), float("nan"), dtype=torch.bfloat16, device=dev)
                launch(x32, w13, s13, h, ids[0], I, mr, wg, cap)
                torch.cuda.synchronize()
                same = bool(torch.equal(h, ref))
                us = graph_us(
                    lambda i, h=h, v=(mr, wg, cap): launch(x32, w13, s13, h, ids[i % 48], I, *v), range(48), 7
                )
                a.setdefault((mr, wg, cap), []).append(us)
                rows.append(dict(shape=shape, part="gemv1", MR=mr, WG=wg, maxnreg=cap, us=us, TBps=b1 / us / 1e6,
                                 same_bits=same))  # fmt: skip
                print(f"{shape} r{rnd} gemv1 MR{mr} WG{wg} cap{cap}: {us:7.2f} us {b1 / us / 1e6:.2f} TB/s same {same}")
        outs = {}
        for rnd in range(2):
            for lab, cfg in calls():
                out = int4_fused_experts(x, *w, tw, ids[0], 0, config=cfg)
                torch.cuda.synchronize()
                ref_out = outs.setdefault("default", out)
                same = bool(torch.equal(out, ref_out))
                us = graph_us(
                    lambda i, cfg=cfg: int4_fused_experts(x, *w, tw, ids[i % 48], 0, config=cfg), range(48), 7
                )
                rows.append(dict(shape=shape, part="call", variant=lab, us=us, TBps=ball / us / 1e6, same_bits=same))
                print(f"{shape} r{rnd} call  {lab}: {us:7.2f} us {ball / us / 1e6:.2f} TB/s same {same}")
    save_json("gemv1_tiles.json", rows)


if __name__ == "__main__":
    compile_only() if "--compile" in sys.argv else main()
