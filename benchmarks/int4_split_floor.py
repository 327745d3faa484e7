"""Read floors of the MoE-TP4 INT4 GEMV's bytes at one token (8 of 384 Kimi-K2.5 experts, I = 512 a rank: gate / up
[1024, 896] int32 words + [1024, 224] bf16 scales, down [7168, 64] words + [7168, 16] scales; 49.5 MB): would one
launch split over the intermediate read them faster than the two launches the kernels use?

- two launches: gemv1's gate / up rows (16 rows a program), then gemv2's down rows (64 whole rows a program);
- one flat launch of the same byte count (the one-launch ceiling);
- split over I: program (expert, chunk of CI intermediate columns) reads its 2 CI gate / up rows, then its CI / 8-word
  slice of every down row and that row's scale of the chunk, writing 7,168 int32 partials (as a fused GEMV would
  write its partial sums for the top-k sum) or one value;
- the down rows alone, whole or as 16- to 64-byte column slices at their 256-byte stride.

Pure reads (XOR, no arithmetic), rotating expert sets over 384 experts (2.1 GB, far more than L2), a CUDA graph of 48
calls, two rounds.

    PYTHONPATH=$PWD python benchmarks/int4_split_floor.py     # JSON to $OUT/int4_split_floor.json (default out/)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from benchmarks.bench_util import graph_us, save_json

E, D, I = 384, 7168, 512
KW, KG = D // 8, D // 32  # a gate / up row: 896 words, 224 scales
NW2, NG2 = I // 8, I // 32  # a down row: 64 words, 16 scales


@triton.jit
def _gate_up_rows(W13, S13, Ids, Out, I: tl.constexpr, KW: tl.constexpr, KG: tl.constexpr, R: tl.constexpr):
    pid = tl.program_id(0)
    nb: tl.constexpr = 2 * I // R
    e = tl.load(Ids + pid // nb).to(tl.int64)
    r = (pid % nb) * R + tl.arange(0, R)
    acc = tl.zeros([R, 128], tl.int32)
    for k in range(0, KW, 128):
        acc ^= tl.load(W13 + e * 2 * I * KW + r[:, None] * KW + k + tl.arange(0, 128)[None, :])
    g = tl.arange(0, 256)[None, :]
    s = tl.load(S13 + e * 2 * I * KG + r[:, None] * KG + g, mask=g < KG, other=0)
    tl.store(Out + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0) ^ tl.xor_sum(tl.xor_sum(s.to(tl.int32), 1), 0))


@triton.jit
def _down_rows(W2, S2, Ids, Out, D: tl.constexpr, NW2: tl.constexpr, NG2: tl.constexpr, RB: tl.constexpr):
    pid = tl.program_id(0)
    nr: tl.constexpr = D // RB
    e = tl.load(Ids + pid // nr).to(tl.int64)
    r = (pid % nr) * RB + tl.arange(0, RB)
    w = tl.load(W2 + e * D * NW2 + r[:, None] * NW2 + tl.arange(0, NW2)[None, :])
    s = tl.load(S2 + e * D * NG2 + r[:, None] * NG2 + tl.arange(0, NG2)[None, :])
    tl.store(Out + r, tl.xor_sum(w, 1) ^ tl.xor_sum(s.to(tl.int32), 1))


@triton.jit
def _down_cols(W2, Ids, Out, D: tl.constexpr, NW2: tl.constexpr, CW: tl.constexpr, RB: tl.constexpr):
    """Program (expert, column block c, row chunk): CW words of each of its RB down rows."""
    pid = tl.program_id(0)
    nc: tl.constexpr = NW2 // CW
    nr: tl.constexpr = D // RB
    e = tl.load(Ids + pid // (nc * nr)).to(tl.int64)
    c = (pid // nr) % nc
    r = (pid % nr) * RB + tl.arange(0, RB)
    w = tl.load(W2 + e * D * NW2 + r[:, None] * NW2 + c * CW + tl.arange(0, CW)[None, :])
    tl.store(Out + pid * CW + tl.arange(0, CW), tl.xor_sum(w, 0))


@triton.jit
def _split(
    W13,
    S13,
    W2,
    S2,
    Ids,
    P,
    I: tl.constexpr,
    D: tl.constexpr,
    KW: tl.constexpr,
    KG: tl.constexpr,
    NW2: tl.constexpr,
    NG2: tl.constexpr,
    CI: tl.constexpr,
    RB: tl.constexpr,
    WRITE: tl.constexpr,
):
    pid = tl.program_id(0)
    nc: tl.constexpr = I // CI
    e = tl.load(Ids + pid // nc).to(tl.int64)
    c = pid % nc
    r = c * CI + tl.arange(0, CI)
    acc = tl.zeros([CI, 128], tl.int32)
    for k in range(0, KW, 128):
        kk = k + tl.arange(0, 128)[None, :]
        acc ^= tl.load(W13 + e * 2 * I * KW + r[:, None] * KW + kk)
        acc ^= tl.load(W13 + e * 2 * I * KW + (I + r[:, None]) * KW + kk)
    g = tl.arange(0, 256)[None, :]
    s1 = tl.load(S13 + e * 2 * I * KG + r[:, None] * KG + g, mask=g < KG, other=0)
    s1 ^= tl.load(S13 + e * 2 * I * KG + (I + r[:, None]) * KG + g, mask=g < KG, other=0)
    h = tl.xor_sum(tl.xor_sum(acc, 1), 0) ^ tl.xor_sum(tl.xor_sum(s1.to(tl.int32), 1), 0)
    CW: tl.constexpr = CI // 8
    for d0 in range(0, D, RB):
        d = d0 + tl.arange(0, RB)
        w = tl.load(W2 + e * D * NW2 + d[:, None] * NW2 + c * CW + tl.arange(0, CW)[None, :])
        sc = tl.load(S2 + e * D * NG2 + d * NG2 + (c * CI) // 32)
        v = tl.xor_sum(w, 1) ^ sc.to(tl.int32) ^ h
        if WRITE:
            tl.store(P + pid * D + d, v)
        else:
            tl.store(P + pid, tl.xor_sum(v, 0))


@triton.jit
def _flat(A, n: tl.constexpr, Out, BLK: tl.constexpr):
    pid = tl.program_id(0)
    o = pid * BLK + tl.arange(0, BLK)
    tl.store(Out + pid, tl.xor_sum(tl.load(A + o, mask=o < n, other=0), 0))


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    w13 = torch.randint(-(2**31), 2**31 - 1, (E, 2 * I, KW), dtype=torch.int32, device=dev)
    s13 = torch.randint(-(2**15), 2**15 - 1, (E, 2 * I, KG), dtype=torch.int16, device=dev)
    w2 = torch.randint(-(2**31), 2**31 - 1, (E, D, NW2), dtype=torch.int32, device=dev)
    s2 = torch.randint(-(2**15), 2**15 - 1, (E, D, NG2), dtype=torch.int16, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = [torch.randperm(E, device=dev, generator=gen)[:8].to(torch.int32) for _ in range(48)]
    out = torch.empty(1 << 22, dtype=torch.int32, device=dev)
    part = torch.empty(512 * D, dtype=torch.int32, device=dev)
    nbytes = 8 * (2 * I * (KW * 4 + KG * 2) + D * (NW2 * 4 + NG2 * 2))
    down_bytes = 8 * D * NW2 * 4
    flat, n = w13.view(-1), nbytes // 4

    def two(i):
        _gate_up_rows[(8 * 2 * I // 16,)](w13, s13, ids[i], out, I, KW, KG, 16, num_warps=8)
        _down_rows[(8 * D // 64,)](w2, s2, ids[i], out, D, NW2, NG2, 64, num_warps=4)

    def one(i):  # 28 disjoint spans of the gate / up buffer
        _flat[(triton.cdiv(n, 4096),)](flat[i % 28 * n :], n, out, 4096, num_warps=8)

    cases = [("two launches (gate/up 16 rows, 8 warps; down 64 rows, 4 warps)", nbytes, two)]
    cases.append(("one flat launch, same bytes", nbytes, one))
    for ci, rb, nw in ((16, 512, 4), (32, 512, 8), (32, 256, 16), (64, 256, 16)):
        for wr in (True, False):
            grid = (8 * I // ci,)
            cases.append(
                (
                    f"split CI={ci} RB={rb} {nw} warps" + (" + partials" if wr else ""),
                    nbytes,
                    lambda i, grid=grid, ci=ci, rb=rb, nw=nw, wr=wr: _split[grid](
                        w13, s13, w2, s2, ids[i], part, I, D, KW, KG, NW2, NG2, ci, rb, wr, num_warps=nw
                    ),
                )
            )
    for cw, rb in ((NW2, 64), (4, 512), (8, 256), (16, 128)):  # the down words alone
        grid = (8 * (NW2 // cw) * (D // rb),)
        cases.append(
            (
                f"down, {4 * cw}-byte column slices (RB {rb})" if cw < NW2 else f"down, whole rows (RB {rb})",
                down_bytes,
                lambda i, grid=grid, cw=cw, rb=rb: _down_cols[grid](w2, ids[i], out, D, NW2, cw, rb, num_warps=4),
            )
        )
    rows = {}
    for _ in range(2):
        for name, nb, fn in cases:
            us = graph_us(fn, range(48), replays=7)
            rows.setdefault(name, dict(case=name, bytes=nb, us=[], TBps=[]))
            rows[name]["us"].append(round(us, 2))
            rows[name]["TBps"].append(round(nb / us / 1e6, 3))
    for r in rows.values():
        print(f"{r['case']:64s} {r['bytes'] / 1e6:6.1f} MB  " + "  ".join(f"{u:6.2f} us" for u in r["us"]))
    print(save_json("int4_split_floor.json", list(rows.values())))


if __name__ == "__main__":
    main()
