"""How fast one launch reads the MoE-TP4 shard's INT4 bytes at one token when each program owns one expert's slice
of the intermediate (its gate and up rows, then the matching columns of every down row): the read-only floor of
an INT4 MoE GEMV with both GEMVs in one launch and no dependency between programs (the down projection split over
the intermediate, partial sums reduced after). Against, in the same run: a plain streaming read of the same bytes
and the engine's `int4_fused_experts` call.

Layout as the checkpoint's (compressed-tensors pack-quantized): w13 int32 [E, 2I, D/8], s13 bf16 [E, 2I, D/32],
w2 int32 [E, D, I/8], s2 bf16 [E, D, I/32]; "contig": the down slice stored contiguously ([E, I/SL, D, SL/8]).

    PYTHONPATH=$PWD python benchmarks/fused_stream_floor.py     # JSON to $OUT/fused_stream_floor.json
"""

import json
import os

import torch
import triton
import triton.language as tl

E, K, D, I = 384, 8, 7168, 512


@triton.jit
def _fused_read(
    W13,
    S13,
    W2,
    S2,
    Ids,
    Out,
    dep,
    SL: tl.constexpr,
    RB: tl.constexpr,
    KB: tl.constexpr,
    CONTIG: tl.constexpr,
    DEP: tl.constexpr,
):
    """Program (pair p, slice j): gate rows j SL .. + SL and their up rows (all D/8 words and D/32 scales of
    each), then the SL / 8 words and one scale of every down row at slice j (RB rows a trip)."""
    NSL: tl.constexpr = 512 // SL
    p = tl.program_id(0) // NSL
    j = tl.program_id(0) % NSL
    e = tl.load(Ids + p).to(tl.int64)
    r = tl.arange(0, SL)[:, None]
    c = tl.arange(0, KB)[None, :]
    acc = tl.zeros([SL, KB], tl.int32)
    wg = W13 + e * (1024 * 896) + (j * SL + r) * 896
    wu = wg + 512 * 896
    for k0 in range(0, 896, KB):
        acc ^= tl.load(wg + k0 + c) ^ tl.load(wu + k0 + c)
    sc = tl.arange(0, 128)[None, :]  # the scales as int32 pairs
    sg = S13 + e * (1024 * 112) + (j * SL + r) * 112
    acc2 = tl.load(sg + sc, mask=sc < 112) ^ tl.load(sg + 512 * 112 + sc, mask=sc < 112)
    s1 = tl.sum(tl.sum(acc, 1), 0) + tl.sum(tl.sum(acc2, 1), 0)
    W: tl.constexpr = SL // 8
    d = tl.arange(0, RB)[:, None]
    w = tl.arange(0, W)[None, :]
    acc3 = tl.zeros([RB, W], tl.int32)
    acc4 = tl.zeros([RB], tl.int32)
    off = 0
    if DEP:
        off = (s1 == dep).to(tl.int32)  # phase 2's addresses wait on phase 1's sum (as the down dot waits on H)
    for d0 in range(0, 7168, RB):
        if CONTIG:
            acc3 ^= tl.load(W2 + e * (7168 * 64) + j * (7168 * W) + (d0 + d) * W + w + off)
            acc4 ^= tl.load(S2 + e * (7168 * NSL) + j * 7168 + d0 + tl.arange(0, RB) + off).to(tl.int32)
        else:
            acc3 ^= tl.load(W2 + e * (7168 * 64) + (d0 + d) * 64 + j * W + w + off)
            acc4 ^= tl.load(S2 + e * (7168 * NSL) + (d0 + tl.arange(0, RB)) * NSL + j + off).to(tl.int32)
    tl.store(Out + tl.program_id(0), s1 + tl.sum(tl.sum(acc3, 1), 0) + tl.sum(acc4, 0))


@triton.jit
def _spin_read(W13, S13, W2, S2, Ids, Out, Cnt, Done, NSL: tl.constexpr, RB: tl.constexpr, KB: tl.constexpr):
    """Program (pair p, slice j of NSL): gate rows j SL .. + SL and their up rows, then (once all NSL programs of
    pair p have arrived) whole down rows j D / NSL .. + D / NSL: the down rows in the checkpoint's layout, read
    contiguously, at the cost of a wait on the pair's other programs (all programs resident at once)."""
    SL: tl.constexpr = 512 // NSL
    p = tl.program_id(0) // NSL
    j = tl.program_id(0) % NSL
    e = tl.load(Ids + p).to(tl.int64)
    r = tl.arange(0, SL)[:, None]
    c = tl.arange(0, KB)[None, :]
    acc = tl.zeros([SL, KB], tl.int32)
    wg = W13 + e * (1024 * 896) + (j * SL + r) * 896
    wu = wg + 512 * 896
    for k0 in range(0, 896, KB):
        acc ^= tl.load(wg + k0 + c) ^ tl.load(wu + k0 + c)
    sc = tl.arange(0, 128)[None, :]
    sg = S13 + e * (1024 * 112) + (j * SL + r) * 112
    acc2 = tl.load(sg + sc, mask=sc < 112) ^ tl.load(sg + 512 * 112 + sc, mask=sc < 112)
    s1 = tl.sum(tl.sum(acc, 1), 0) + tl.sum(tl.sum(acc2, 1), 0)
    tl.store(Out + 4096 + tl.program_id(0), s1)
    tl.atomic_add(Cnt + p, 1, sem="release")
    ROWS: tl.constexpr = 7168 // NSL
    d = tl.arange(0, RB)[:, None]
    w = tl.arange(0, 64)[None, :]
    base = W2 + e * (7168 * 64) + (j * ROWS) * 64
    first = tl.load(base + d * 64 + w, mask=d < ROWS)
    n = tl.atomic_add(Cnt + p, 0, sem="acquire")
    while n < NSL:
        n = tl.atomic_add(Cnt + p, 0, sem="acquire")
    acc3 = first ^ tl.load(Out + 4096 + p * NSL + (j + 1) % NSL, cache_modifier=".cg")
    for d0 in range(RB, ROWS, RB):
        acc3 ^= tl.load(base + (d0 + d) * 64 + w, mask=d0 + d < ROWS)
    s8 = tl.arange(0, 8)[None, :]
    acc4 = tl.load(
        S2 + e * (7168 * 8) + (j * ROWS + tl.arange(0, 1024)[:, None]) * 8 + s8, mask=tl.arange(0, 1024)[:, None] < ROWS
    )
    if tl.atomic_add(Done + p, 1, sem="relaxed") == NSL - 1:  # the last one out resets the pair's counts
        tl.atomic_xchg(Cnt + p, 0, sem="relaxed")
        tl.atomic_xchg(Done + p, 0, sem="relaxed")
    tl.store(Out + tl.program_id(0), s1 + tl.sum(tl.sum(acc3, 1), 0) + tl.sum(tl.sum(acc4, 1), 0))


@triton.jit
def _sum_kernel(X, Out, n, per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_prog
    acc = tl.zeros([BLOCK], tl.int32)
    for off in range(0, per_prog, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc ^= tl.load(X + idx, mask=idx < n, other=0)
    tl.store(Out + pid, tl.sum(acc))


def timed(fn, n):
    for i in range(3):
        fn(i)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        g.replay()
        en.record()
        torch.cuda.synchronize()
        ts.append(st.elapsed_time(en) / n * 1000)
    return sorted(ts)[3]


def main():
    torch.manual_seed(0)
    dev = "cuda"
    w13 = torch.randint(-(2**31), 2**31 - 1, (E, 2 * I, D // 8), dtype=torch.int32, device=dev)
    s13 = (torch.rand(E, 2 * I, D // 32, device=dev) * 0.01).to(torch.bfloat16)
    w2 = torch.randint(-(2**31), 2**31 - 1, (E, D, I // 8), dtype=torch.int32, device=dev)
    s2 = (torch.rand(E, D, I // 32, device=dev) * 0.01).to(torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in (w13, s13, w2, s2)) / E * K
    NR = 48
    ids = [torch.randperm(E, device=dev)[:K].to(torch.int32) for _ in range(NR)]
    out = torch.zeros(4096, dtype=torch.int32, device=dev)
    rows = []

    def rec(name, us, **kw):
        rows.append(dict(name=name, us=us, TBps=nbytes / us / 1e6, **kw))
        print(f"{name:48s} {us:7.2f} us  {nbytes / us / 1e6:.2f} TB/s", flush=True)

    s13i = s13.view(torch.int32)
    for SL in (32,):
        nsl = I // SL
        s2i = s2.view(torch.int16 if SL == 32 else torch.int32)  # a row's SL / 32 scales of a slice as one element
        w2c = w2.view(E, D, nsl, SL // 8).transpose(1, 2).contiguous()
        s2c = s2i.view(E, D, nsl).transpose(1, 2).contiguous()
        for contig in (False, True):
            for dep in (True,):
                for warps in (8, 16):
                    for rb in (512,):
                        for kb in (128,):

                            def f(
                                i, SL=SL, contig=contig, dep=dep, warps=warps, rb=rb, kb=kb, nsl=nsl, c=(w2c, s2c, s2i)
                            ):
                                _fused_read[(K * nsl,)](
                                    w13,
                                    s13i,
                                    c[0] if contig else w2,
                                    c[1] if contig else c[2],
                                    ids[i % NR],
                                    out,
                                    -7,
                                    SL=SL,
                                    RB=rb,
                                    KB=kb,
                                    CONTIG=contig,
                                    DEP=dep,
                                    num_warps=warps,
                                )

                            try:
                                us = timed(f, NR)
                            except Exception as ex:  # noqa: BLE001 (a tile that does not compile is skipped)
                                print("skip", SL, contig, dep, warps, rb, kb, type(ex).__name__)
                                continue
                            rec(
                                f"fused SL{SL} {'contig' if contig else 'strided'} {'dep' if dep else 'nodep'} "
                                f"w{warps} rb{rb} kb{kb}",
                                us,
                                SL=SL,
                                contig=contig,
                                dep=dep,
                                warps=warps,
                                rb=rb,
                                kb=kb,
                            )
        del w2c, s2c
    cnt = torch.zeros(2 * K, dtype=torch.int32, device=dev)
    s2w = s2.view(torch.int32)
    for nsl in (16, 32):
        for warps in (4, 8, 16):
            for rb in (32, 64, 128):
                if rb > 7168 // nsl * 2:
                    continue

                def f(i, nsl=nsl, warps=warps, rb=rb):
                    _spin_read[(K * nsl,)](
                        w13, s13i, w2, s2w, ids[i % NR], out, cnt, cnt[K:], NSL=nsl, RB=rb, KB=128, num_warps=warps
                    )

                us = timed(f, NR)
                torch.cuda.synchronize()
                assert int(cnt.abs().sum()) == 0, cnt
                rec(f"spin NSL{nsl} w{warps} rb{rb}", us, nsl=nsl, warps=warps, rb=rb)
    # a plain streaming read of the same number of bytes
    n = int(nbytes / 4)
    bufs = [torch.randint(0, 100, (n,), dtype=torch.int32, device=dev) for _ in range(NR)]
    best = None
    for progs in (132, 264, 528, 1056):
        for block, warps in ((2048, 4), (4096, 8)):
            per = triton.cdiv(triton.cdiv(n, progs), block) * block
            us = timed(
                lambda i, bufs=bufs: _sum_kernel[(triton.cdiv(n, per),)](
                    bufs[i % NR], out, n, per, BLOCK=block, num_warps=warps
                ),
                NR,
            )
            best = min(best or (us, progs), (us, progs))
    rec("plain stream, best grid", best[0], grid=best[1])
    del bufs
    # the one-launch kernel alone, and with no down rows (gemv1, its stores and the wait on the pair)
    from mlaserve.kernels.int4_mma_fused import int4_gemv_fused

    hb = torch.empty(K, I, dtype=torch.bfloat16, device=dev)
    yb = torch.empty(K, D, dtype=torch.bfloat16, device=dev)
    xk = torch.randn(1, D, device=dev).to(torch.bfloat16)
    twk = torch.rand(1, K, device=dev)
    nopdl = dict(PDL=False, launch_pdl=False)
    for nrows in (None, 0):
        us = timed(
            lambda i, r=nrows: int4_gemv_fused(xk, w13, s13, w2, s2, twk, ids[i % NR], 0, hb, yb, nopdl, rows=r), NR
        )
        rec(f"one-launch kernel alone{' (gemv1 + wait only)' if nrows == 0 else ''}", us, down_rows=nrows)
    # the engine's call on the same weights
    from mlaserve.kernels.int4_moe import int4_fused_experts

    x = torch.randn(1, D, device=dev).to(torch.bfloat16)
    tw = torch.rand(1, K, device=dev)
    ids2 = [i.view(1, K).long() for i in ids]
    for rnd in range(3):  # the two forms alternating, same weights and routings
        for fused in (False, True):
            us = timed(
                lambda i, c=dict(fused=fused): int4_fused_experts(x, w13, s13, w2, s2, tw, ids2[i % NR], 0, config=c),
                NR,
            )
            rec(
                f"int4_fused_experts {'one launch' if fused else 'two launches'} (with top-k sum) r{rnd}",
                us,
                fused=fused,
                round=rnd,
            )
    # the MoE-TP8 shard (I = 256), the engine's call both ways
    from tests.helpers.int4_ref import random_int4_experts

    w8 = random_int4_experts(E, D, 256, dev)
    b8 = sum(t.numel() * t.element_size() for t in w8) / E * K
    for rnd in range(3):
        for fused in (False, True):
            us = timed(lambda i, c=dict(fused=fused): int4_fused_experts(x, *w8, tw, ids2[i % NR], 0, config=c), NR)
            rows.append(dict(name="tp8", us=us, TBps=b8 / us / 1e6, fused=fused, round=rnd))
            print(
                f"TP8 int4_fused_experts {'one launch' if fused else 'two launches'} r{rnd} {us:7.2f} us "
                f"{b8 / us / 1e6:.2f} TB/s",
                flush=True,
            )
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    json.dump(
        dict(gpu=torch.cuda.get_device_name(), bytes=nbytes, rows=rows),
        open(os.path.join(os.environ.get("OUT", "out"), "fused_stream_floor.json"), "w"),
        indent=1,
    )


if __name__ == "__main__":
    main()
