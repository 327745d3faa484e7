"""kernels_bench's decode-step sweeps (sections moe_decode, lin_decode, absorb, launch): the kernels of a batch-1..32
decode step timed over several layers' weights in turn, as the engine reads them, against their alternatives.

    PYTHONPATH=$PWD python benchmarks/kernels_bench.py --only moe_decode,lin_decode,absorb,launch
"""

from __future__ import annotations

import functools

import torch

from benchmarks.bench_util import BF, Report, Sizes, bench, cfg_label, moe_inputs, rel

MOE_DEC_TILES = [
    (64, 128, 4, 4),
    (32, 128, 4, 4),
    (16, 128, 4, 4),
    (32, 128, 4, 3),
    (32, 256, 4, 3),
    (16, 256, 4, 3),
    (16, 256, 4, 4),
    (32, 64, 4, 6),
    (16, 128, 2, 4),
    (32, 128, 2, 4),
    (64, 64, 4, 6),
    (64, 128, 8, 4),
    (16, 64, 2, 8),
    (32, 128, 4, 5),
    (128, 128, 8, 3),
    (128, 64, 4, 4),
]


def run_moe_decode(rep: Report, sz: Sizes):
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.moe_config import moe_config

    L, S, tiles = sz.layers, sz.decode_shared, MOE_DEC_TILES[: sz.decode_max_cfgs]
    D, I, E, K = sz.moe[next(iter(sz.moe))]
    w13 = [(torch.randn(E, 2 * I, D, device=sz.dev) / D**0.5).to(BF) for _ in range(L)]
    w2 = [(torch.randn(E, D, I, device=sz.dev) / I**0.5).to(BF) for _ in range(L)]
    sh = [
        (
            (torch.randn(S * I, D, device=sz.dev) / D**0.5).to(BF),
            (torch.randn(S * I, D, device=sz.dev) / D**0.5).to(BF),
            (torch.randn(D, S * I, device=sz.dev) / I**0.5).to(BF),
        )
        for _ in range(L)
    ]
    cfgs = [None] + [dict(gemm1=dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)) for n, k, w, s in tiles]
    cfgs += [dict(gemm2=dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)) for n, k, w, s in tiles]
    # TMA weight tiles (the default on sm_90, at 2 / 3 stages: moe_config.py) against the pointer loads, and stages
    cfgs += [
        dict(tma=False),
        dict(tma=True, gemm1=dict(num_stages=3), gemm2=dict(num_stages=4)),
        dict(tma=True, gemm1=dict(num_stages=2), gemm2=dict(num_stages=2)),
        dict(tma=True, gemm1=dict(num_stages=2, BLOCK_N=64), gemm2=dict(num_stages=2, BLOCK_N=128)),
    ]
    for T in sz.decode_T:
        x, ids, w = moe_inputs(T, D, E, K, sz.dev)
        ids = torch.cat([ids, torch.arange(E, E + S, device=sz.dev).expand(T, S)], 1)  # the shared slots
        w = torch.cat([w, torch.ones(T, S, device=sz.dev)], 1)
        n_exp = int(ids.unique().numel())
        d1, d2 = moe_config(T, K + S, E + S, D, I, BF)
        ref = fused_experts(x, w13[0], w2[0], w, ids, 0, shared=sh[0])
        for cfg in cfgs:
            label = (
                "default g1 [" + cfg_label(d1) + "] g2 [" + cfg_label(d2) + "]"
                if cfg is None
                else " ".join(f"{g} {cfg_label(c)}" if isinstance(c, dict) else f"{g}={c}" for g, c in cfg.items())
            )
            try:
                err = rel(fused_experts(x, w13[0], w2[0], w, ids, 0, config=cfg, shared=sh[0]), ref)
                ms = (
                    bench(
                        lambda c=cfg: [
                            fused_experts(
                                x,
                                w13[i],
                                w2[i],
                                w,
                                ids,
                                0,
                                config=c,  # noqa: B023
                                shared=sh[i],
                            )
                            for i in range(L)
                        ],
                        sz,
                    )
                    / L
                )
                rep.add("moe_decode", f"T={T} {label}", ms, n_exp * 3 * D * I * 2, err=err, T=T, config=cfg)
            except Exception as e:  # e.g. out of shared memory
                print(f"moe_decode T={T} {label}: {type(e).__name__}: {str(e)[:120]}")
    w13 = w2 = sh = None
    if sz.dev == "cuda":
        torch.cuda.empty_cache()


GEMV_CFGS = [
    (4, 2048, 4),
    (4, 2048, 2),
    (4, 2048, 8),
    (2, 2048, 2),
    (2, 2048, 4),
    (1, 2048, 1),
    (1, 2048, 2),
    (4, 1024, 2),
    (2, 1024, 1),
    (8, 2048, 8),
    (8, 1024, 2),
    (4, 512, 1),
]


def run_linear_decode(rep: Report, sz: Sizes):
    """The decode-sized dense projections (M1: q|kv_a [3648, 2048], o_proj [2048, 2048]) as F.linear (the
    engine's cuBLAS GEMM), torch.mv and W @ x^T, over sz.layers weights in turn."""
    import torch.nn.functional as F

    L = sz.layers
    for N, Kd in sz.decode_linears:
        ws = [(torch.randn(N, Kd, device=sz.dev) / Kd**0.5).to(BF) for _ in range(L)]
        for T in sz.decode_linear_T:
            x = torch.randn(T, Kd, device=sz.dev).to(BF)
            ref = F.linear(x.float(), ws[0].float())
            variants = {"F.linear": lambda w: F.linear(x, w), "W @ x^T": lambda w: (w @ x.t()).t()}  # noqa: B023
            from mlaserve.kernels.gemv import GEMV_MAX_TOKENS, gemv

            if T == 1:
                variants["torch.mv"] = lambda w: torch.mv(w, x[0])[None]  # noqa: B023
                for bn, bk, nw in GEMV_CFGS[: sz.decode_max_cfgs]:
                    c = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)
                    variants[f"gemv N{bn} K{bk} w{nw}"] = lambda w, c=c: gemv(x, w, c)  # noqa: B023
            elif T <= GEMV_MAX_TOKENS:  # several rows from one weight tile: the default tile, and 4 columns
                variants["gemv default"] = lambda w: gemv(x, w)  # noqa: B023
                variants["gemv N4 K2048 w4"] = lambda w: gemv(x, w, dict(BLOCK_N=4, BLOCK_K=2048, num_warps=4))  # noqa: B023
            for name, fn in variants.items():
                try:
                    err = rel(fn(ws[0]), ref)
                    ms = bench(lambda f=fn: [f(w) for w in ws], sz) / L  # noqa: B023
                    rep.add("lin_decode", f"[{N}, {Kd}] T={T} {name}", ms, N * Kd * 2, err=err, T=T)
                except Exception as e:  # e.g. out of registers
                    print(f"lin_decode [{N}, {Kd}] T={T} {name}: {type(e).__name__}: {str(e)[:120]}")
        ws = None


def loop_tiles() -> dict:
    """bi_gemm's loop-form tiles kernels_bench forces (BLOCK_K 64 as TILES_16's; one wgmma shape per warpgroup, m64
    x BLOCK_N): the 64x64 tile, the 128x128 one the default takes on large grids, and 128x64 between them."""
    from mlaserve.kernels.bi_gemm import TILES_16, TILES_16_LARGE

    return {
        "64x64w4": TILES_16,
        "128x64w8": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4),
        "128x128w8": TILES_16_LARGE,
    }


def run_bi_gemm(rep: Report, sz: Sizes):
    """Deterministic mode's dense GEMM (kernels/bi_gemm.py: one BLOCK_K and K split at every M, fixed by the
    weight's shape) against F.linear (cuBLAS) at M1's linears and decode to prefill row counts: the mode's GEMM cost
    in the form and tile it picks by M and in each form forced, every row checked equal to the largest M's; from 256
    rows each loop-form tile forced (loop_tiles), its bits checked against the 64x64 tile's."""
    import torch.nn.functional as F

    from mlaserve.kernels.bi_gemm import TILES_16, bi_gemm, k_splits

    forced = loop_tiles()

    for N, Kd in sz.bi_gemm_shapes:
        w = (torch.randn(N, Kd, device=sz.dev) / Kd**0.5).to(BF)
        xs = torch.randn(max(sz.bi_gemm_M), Kd, device=sz.dev).to(BF)
        full = bi_gemm(xs, w)
        full64 = bi_gemm(xs, w, tiles=TILES_16)
        S, chunk = k_splits(1, N, Kd, TILES_16)
        for M in sz.bi_gemm_M:
            x = xs[:M]
            ref = F.linear(x.float(), w.float())
            forms = {"bi_gemm": None, "bi_gemm loop": False, "bi_gemm split": True} if S > 1 else {"bi_gemm": None}
            same = all(torch.equal(bi_gemm(x, w, split=f), full[:M]) for f in forms.values())
            fns = {"F.linear": lambda: F.linear(x, w)}  # noqa: B023
            fns.update({name: functools.partial(bi_gemm, x, w, split=f) for name, f in forms.items()})
            for name, fn in fns.items():
                ms = bench(fn, sz)
                nbytes, flops = (N * Kd + M * Kd + M * N) * 2, 2 * M * N * Kd
                err = rel(fn(), ref)
                rep.add("bi_gemm", f"[{N}, {Kd}] M={M} {name}", ms, nbytes, flops, err=err, M=M, rows_equal=same, S=S)
            if M >= 256:  # loop-form tiles forced: faster prefill if their MMA gives the 64x64 tile's bits
                for name, t in forced.items():
                    fn = functools.partial(bi_gemm, x, w, tiles=t)
                    ms = bench(fn, sz)
                    eq = bool(torch.equal(fn(), full64[:M]))
                    nbytes, flops = (N * Kd + M * Kd + M * N) * 2, 2 * M * N * Kd
                    rep.add("bi_gemm", f"[{N}, {Kd}] M={M} bi_gemm {name}", ms, nbytes, flops, M=M, rows_equal=eq, S=S)
                    if not eq:
                        print(f"bi_gemm [{N}, {Kd}] M={M} {name}: bits differ from the 64x64 tile's")
            if not same:
                print(f"bi_gemm [{N}, {Kd}] M={M}: rows differ from M={max(sz.bi_gemm_M)}'s")
        w = xs = full = full64 = None


def run_gqa(rep: Report, sz: Sizes):
    """The EAGLE3 draft's paged attention (kernels/gqa_decode.py, split-KV) at the drafts' head counts (M1's 16,
    Kimi-K2.5's 64; MHA, head_dim 128), decode (q_len 1) and the extension after a verify (q_len 2), against the
    same kernel with one split (one program per request and head walking the whole context); error against fp32
    attention over the gathered pages."""
    from mlaserve.kernels.gqa_decode import gqa_decode, num_splits

    ps = 64
    for H, KVH, d in sz.gqa_heads:
        for ctx in sz.gqa_ctx:
            for B in sz.gqa_B:
                for q_len in (1, 2):
                    n_pages = B * -(-ctx // ps)
                    cache = torch.randn(n_pages, ps, 2, KVH, d, device=sz.dev).to(BF)
                    table = torch.randperm(n_pages, device=sz.dev).view(B, -1).to(torch.int32)
                    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=sz.dev)
                    q = torch.randn(B * q_len, H, d, device=sz.dev).to(BF)
                    out = torch.empty_like(q)
                    vis = (
                        torch.arange(ctx, device=sz.dev)[None, :]
                        <= (ctx - q_len + torch.arange(q_len, device=sz.dev))[:, None]
                    )
                    ref = torch.empty(B, q_len, H, d, device=sz.dev)
                    for b in range(B):  # one request at a time: a whole batch's fp32 K and V reach 2^30 elements
                        kv = cache[table[b].long()].reshape(-1, 2, KVH, d)[:ctx].float()  # [ctx, 2, KVH, d]
                        kb, vb = (kv[:, i].repeat_interleave(H // KVH, 1) for i in (0, 1))  # [ctx, H, d]
                        s = torch.einsum("jhd,nhd->jhn", q.view(B, q_len, H, d)[b].float(), kb) * d**-0.5
                        p = torch.softmax(s.masked_fill(~vis[:, None, :], float("-inf")), dim=-1)
                        ref[b] = torch.einsum("jhn,nhd->jhd", p, vb)
                    ref = ref.reshape(B * q_len, H, d)
                    if q.is_cuda:  # a fault in the reference is reported here, not in the timing
                        torch.cuda.synchronize()
                    kv = kb = vb = s = p = None
                    nbytes = B * ctx * KVH * d * 2 * 2
                    for name, S in (("split-KV", None), ("one split", 1)):
                        fn = functools.partial(gqa_decode, q, cache, table, seq_lens, q_len, d**-0.5, out, splits=S)
                        ms = bench(fn, sz)
                        err = rel(fn(), ref)
                        label = f"H={H} ctx={ctx} B={B} q_len={q_len} {name}"
                        rep.add("gqa", label, ms, nbytes, err=err, splits=S or num_splits(B, KVH))
                    cache = ref = None


HEAD_GEMV_BN = {"q": (8, 16, 32, 64), "out": (2, 4, 8, 16)}


def run_absorb(rep: Report, sz: Sizes):
    """MLA's absorbed projections in small decode steps (M1: 16 heads, w_kc [16, 128, 512] and the transposed
    w_vc view [16, 512, 128] of one kv_b_proj weight): torch.bmm into the strided views (the projection contract)
    against head_gemv's tiles, over sz.layers weights in turn."""
    from mlaserve.kernels.head_gemv import head_gemv

    H, N, V, R = sz.absorb_heads, 128, 128, 512
    if sz.dev != "cuda":
        N, V, R = 16, 8, 32
    ws = [(torch.randn(H * (N + V), R, device=sz.dev) / R**0.5).to(BF).view(H, N + V, R) for _ in range(sz.layers)]
    for T in sz.absorb_T:
        for side, K, M in (("q", N, R), ("out", R, V)):
            mats = [w[:, :N] if side == "q" else w[:, N:].transpose(1, 2) for w in ws]  # [H, K, M]
            x = torch.randn(T, H, K, device=sz.dev).to(BF)
            y = torch.empty(T, H, M, device=sz.dev, dtype=BF)
            ref = torch.bmm(x.float().transpose(0, 1), mats[0].float()).transpose(0, 1)
            variants = {"bmm": lambda m: torch.bmm(x.transpose(0, 1), m, out=y.transpose(0, 1))}  # noqa: B023
            for bn in HEAD_GEMV_BN[side][: sz.decode_max_cfgs]:
                for nw in (1, 2, 4):
                    c = dict(BLOCK_N=min(bn, M), num_warps=nw)
                    variants[f"head_gemv N{c['BLOCK_N']} w{nw}"] = lambda m, c=c: head_gemv(x, m, y, c)  # noqa: B023
            for name, fn in variants.items():
                try:
                    y.fill_(float("nan"))
                    fn(mats[0])
                    err = rel(y, ref)
                    ms = bench(lambda f=fn: [f(m) for m in mats], sz) / len(mats)  # noqa: B023
                    rep.add("absorb", f"{side} [{H}, {K}, {M}] T={T} {name}", ms, H * K * M * 2, err=err, T=T)
                except Exception as e:  # e.g. out of registers
                    print(f"absorb {side} T={T} {name}: {type(e).__name__}: {str(e)[:120]}")
    ws = None


def run_launch(rep: Report, sz: Sizes):
    """What one kernel costs in a CUDA graph whatever its work (the batch-1 decode step is ~400 such kernels in a
    row): sz.launch_n back-to-back launches of a one-store Triton kernel (1 and 132 programs), and of the batch-1
    add_rms_norm ([1, 2048] bf16), timed as graph replays, per launch."""
    import triton
    import triton.language as tl

    from mlaserve.kernels.rmsnorm import add_rms_norm

    @triton.jit
    def _one_store(Out):
        tl.store(Out + tl.program_id(0), 1)

    n = sz.launch_n
    flag = torch.zeros(132, dtype=torch.int32, device=sz.dev)
    for programs in (1, 132):
        ms = bench(lambda p=programs: [_one_store[(p,)](flag, num_warps=1) for _ in range(n)], sz) / n
        rep.add("launch", f"one-store kernel, {programs} programs", ms, programs=programs)
    x, r = torch.randn(1, 2048, device=sz.dev).to(BF), torch.randn(1, 2048, device=sz.dev).to(BF)
    w = torch.ones(2048, device=sz.dev).to(BF)
    ms = bench(lambda: [add_rms_norm(x, r, w, 1e-6) for _ in range(n)], sz) / n
    rep.add("launch", "add_rms_norm [1, 2048] bf16", ms, 4 * 2048 * 2)
