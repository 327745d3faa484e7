"""kernels_bench's INT4 MoE section (int4_moe): kernels/int4_moe.py at Kimi-K2.5's expert shapes against the bf16
fused_experts on the same (dequantized) weights, torch's `_weight_int4pack_mm` as an anchor, and tile sweeps.

    PYTHONPATH=$PWD python benchmarks/kernels_bench.py --only int4_moe --time-limit 900
    INT4_BENCH_SHAPES=kimi-tp4,kimi-ep8 ... --only int4_moe     # some shapes only (a run under 10 minutes)
    INT4_BENCH_STEPS=1,2,8 INT4_BENCH_SWEEPS=0 ...               # some steps; no GEMM/FMA sweeps nor anchor
    INT4_BENCH_BF16=0 INT4_BENCH_FORMS=gemv_mma,gemm ...           # no bf16 fused_experts rows; these forms only
    INT4_BENCH_BOTH=8,32,64 ...                                     # steps timed in both forms (default 8,32)

Shapes: kimi (7168 -> 2048, 384 experts), kimi-tp2 (I=1024), kimi-tp4 (I=512), kimi-tp8 (I=256), kimi-ep8 (48 local
experts of 384: `busy` routes every pair to a local expert, as the busiest rank sees it, and runs as all-local;
`random` over all 384, about one local pair a token, with the expert count the engine passes). Steps of 1, 2
tokens (decode, verify: the GEMV form), 8 and 32 (both forms) and a 2048-token prefill chunk (the GEMM form). Each
timed call cycles through ROTATE routings over disjoint experts, so the weights stream from HBM, not L2 (the union
exceeds its 50 MB). bytes: what one call reads, packed words +
scales of the distinct local experts it selects + x; TB/s against the 4.3 TB/s copy ceiling. The bf16 rows time
fused_experts on the same weights dequantized to bf16 (2 bytes a weight). Rows `gemv kernels` time the two GEMV
launches alone (no sum). `form*` marks the form int4_fused_experts picks by default; where the GEMV form runs, the
FMA GEMV (gemv_fma) and the tensor-core one (gemv_mma) are both timed, the latter at 2-8 tokens also without
pairing (`unpaired`). Rows `mma kernels` time the tensor-core GEMV's two launches alone, default tiles then
MMA_SWEEP (MMA_QUICK with INT4_BENCH_SWEEPS=0) at one token, then the fastest of them together at 1, 2 and 8."""

from __future__ import annotations

import os
import time

import torch

from benchmarks.bench_util import BF, Report, Sizes, bench, cfg_label, rel

SHAPES = {  # name: D, I, local experts, all experts
    "kimi": (7168, 2048, 384, 384),
    "kimi-tp2": (7168, 1024, 384, 384),
    "kimi-tp4": (7168, 512, 384, 384),
    "kimi-tp8": (7168, 256, 384, 384),
    "kimi-ep8": (7168, 2048, 48, 384),
}
SMOKE_SHAPES = {"tiny": (64, 32, 4, 8)}  # --smoke: EP (4 local experts of 8), both routings
STEPS = (1, 2, 8, 32, 2048)
BOTH_FORMS = (8, 32)  # steps timed in both forms
ROTATE = 6
# tile sweeps: gemv1 / gemv2 at one token, gemm1+gemm2 at the prefill chunk (default first in each)
GEMV1_SWEEP = [
    dict(ROWS=16, PREFETCH=False),
    dict(ROWS=8, PREFETCH=True),
    dict(ROWS=8, PREFETCH=False),
    dict(ROWS=4, PREFETCH=True),
    dict(ROWS=16, PREFETCH=True),
    dict(ROWS=16, G=16, PREFETCH=False),
    dict(ROWS=8, num_warps=2, PREFETCH=False),
    dict(ROWS=16, num_warps=8, PREFETCH=True),
]
GEMV2_SWEEP = [  # ROWS scaled per shape: x1 is the default's 8 KB of words a program
    dict(ROWS_X=1),
    dict(ROWS_X=2),
    dict(ROWS_X=0.5),
    dict(ROWS_X=1, num_warps=8),
    dict(ROWS_X=2, num_warps=8),
    dict(ROWS_X=1, G_HALF=True, PREFETCH=True),
]
GEMM_SWEEP = [
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, TRANS=True),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, TRANS=True),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, TRANS=True),
]


# tensor-core GEMV tiles per (D, I): gemv1 variants (timed with the default gemv2), gemv2 variants (with the default
# gemv1); the fastest of each are then timed together at 1, 2 and 8 tokens. MMA_QUICK: the few timed without
# INT4_BENCH_SWEEPS. The GPU tests check every one of them.
_B = dict(MUL=False)
_CAP = dict(MUL=False, maxnreg=64)
MMA_SWEEP = {
    (7168, 2048): (
        [
            dict(MR=4, WG=4, **_B),
            dict(MR=2, WG=4, MUL=True, maxnreg=64),
            dict(MR=1, WG=4, **_CAP),
            dict(MR=2, WG=4, **_CAP, NS=2),
            dict(MR=2, WG=8, **_B, PREFETCH=True),
        ],
        [
            dict(MR=2, WG=4, **_B),
            dict(MR=2, WG=2, **_CAP),
            dict(MR=1, WG=2, **_CAP),
            dict(MR=1, WG=4, **_CAP),
            dict(MR=1, WG=16, **_B, NB=2),
        ],
    ),
    (7168, 512): (
        [
            dict(MR=2, WG=4, **_CAP),
            dict(MR=1, WG=4, **_B, PREFETCH=True),
            dict(MR=1, WG=8, **_B, NS=3),
            dict(MR=2, WG=16, **_CAP),
        ],
        [
            dict(MR=1, WG=4, **_B),
            dict(MR=2, WG=2, **_CAP),
            dict(MR=2, WG=4, **_CAP),
            dict(MR=1, WG=4, **_B, NB=4),
            dict(MR=2, WG=4, **_B, NB=2, NS=2),
        ],
    ),
    (7168, 256): (
        [
            dict(MR=2, WG=4, **_CAP),
            dict(MR=1, WG=8, **_B, NS=3),
            dict(MR=1, WG=16, **_CAP),
        ],
        [
            dict(MR=2, WG=2, **_CAP),
            dict(MR=2, WG=2, **_B, NB=4, NS=4),
            dict(MR=1, WG=2, **_B, NB=8),
            dict(MR=4, WG=2, **_B),
        ],
    ),
}
MMA_QUICK = {
    (7168, 2048): ([], [dict(MR=2, WG=4, **_CAP), dict(MR=1, WG=4, **_CAP)]),
    (7168, 1024): ([], [dict(MR=2, WG=4, **_B)]),
    (7168, 512): ([dict(MR=2, WG=4, **_CAP)], [dict(MR=2, WG=4, **_B)]),
    (7168, 256): ([dict(MR=2, WG=4, **_CAP)], [dict(MR=2, WG=2, **_CAP)]),
}
FMA_EXTRA = [(dict(ROWS=32, num_warps=8), {}), ({}, dict(maxnreg=64))]  # gemv1 / gemv2 overrides, at (7168, 2048)
MMA_BEST: dict = {}  # (D, I) -> the fastest (gemv1, gemv2) at one token


def mma_variants(D: int, I: int, pairs: int, sweep: bool, table: dict = MMA_SWEEP) -> list[tuple[dict, dict]]:
    """(gemv1, gemv2) MMA configs: the default, then (sweep) the table's for the shape."""
    from mlaserve.kernels.int4_moe import mma_config

    c1, c2 = mma_config(D, I, pairs)
    out = [(c1, c2)]
    if sweep:
        v1, v2 = table.get((D, I), ([], []))
        out += [(v, c2) for v in v1 if v != c1] + [(c1, v) for v in v2 if v != c2]
    return out


def gemv2_variant(v: dict, D: int, I: int, pairs: int) -> dict:
    """A GEMV2_SWEEP entry as a gemv2 config for this shape."""
    from mlaserve.kernels.int4_moe import gemv_config

    base = gemv_config(D, I, pairs)[1]
    c = dict(base, ROWS=max(4, min(256, int(base["ROWS"] * v["ROWS_X"]))))
    if v.get("G_HALF") and base["G"] > 1:
        c["G"] = base["G"] // 2
    return dict(c, **{k: val for k, val in v.items() if k not in ("ROWS_X", "G_HALF")})


def expert_bytes(D: int, I: int) -> int:
    """Packed words + bf16 scales of one expert (gate, up and down)."""
    return 2 * I * (D // 8 * 4 + D // 32 * 2) + D * (I // 8 * 4 + I // 32 * 2)


def routings(T: int, K: int, E_local: int, E_all: int, busy: bool, dev) -> list[torch.Tensor]:
    """ROTATE routings [T, K] over disjoint experts where they fit (each call reads new weights), else random top-K.
    busy: every id local (in [0, E_local)); else drawn over all E_all ids (EP: ids >= E_local are other ranks')."""
    span = E_local if busy else E_all
    if T * K * ROTATE <= span:
        return list(torch.randperm(span, device=dev)[: T * K * ROTATE].reshape(ROTATE, T, K))
    return [torch.rand(T, span, device=dev).topk(K, -1).indices for _ in range(ROTATE)]


def dequant_bf16(w: tuple, D: int, I: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts dequantized to bf16, a few at a time (fp32 intermediates of all 384 would not fit)."""
    from tests.helpers.int4_ref import dequant_int4

    w13p, w13s, w2p, w2s = w
    E = w13p.shape[0]
    w13 = torch.empty(E, 2 * I, D, dtype=BF, device=w13p.device)
    w2 = torch.empty(E, D, I, dtype=BF, device=w13p.device)
    for e0 in range(0, E, 16):
        sl = slice(e0, e0 + 16)
        w13[sl] = dequant_int4(w13p[sl], w13s[sl], D).to(BF)
        w2[sl] = dequant_int4(w2p[sl], w2s[sl], I).to(BF)
    return w13, w2


def run_int4_moe(rep: Report, sz: Sizes):
    dev = sz.dev
    if dev != "cuda":  # --smoke: the interpreter, rounding bf16 casts as the GPU does
        from tests.helpers.interp_bf16 import bf16_round_to_nearest

        with bf16_round_to_nearest():
            return _run(rep, sz, SMOKE_SHAPES, (1, 5), 2)
    only = os.environ.get("INT4_BENCH_SHAPES")
    shapes = {k: v for k, v in SHAPES.items() if not only or k in only.split(",")}
    steps = tuple(int(t) for t in os.environ.get("INT4_BENCH_STEPS", ",".join(map(str, STEPS))).split(","))
    return _run(rep, sz, shapes, steps, 8)


def _run(rep: Report, sz: Sizes, shapes: dict, steps: tuple, K: int):
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.int4_moe import (
        default_form,
        gemm_config,
        gemv_config,
        int4_fused_experts,
        mma_config,
        mma_preferred,
    )
    from tests.helpers.int4_ref import int4_fused_experts_ref, random_int4_experts

    dev = sz.dev
    bf16 = os.environ.get("INT4_BENCH_BF16", "1") != "0"
    sweeps = os.environ.get("INT4_BENCH_SWEEPS", "1") != "0"
    only_forms = [f for f in os.environ.get("INT4_BENCH_FORMS", "").split(",") if f]
    both = tuple(int(t) for t in os.environ.get("INT4_BENCH_BOTH", ",".join(map(str, BOTH_FORMS))).split(","))
    for name, (D, I, E, E_all) in shapes.items():
        w = random_int4_experts(E, D, I, dev)
        w13, w2 = dequant_bf16(w, D, I) if bf16 else (None, None)
        for T in steps:
            for busy in (True, False) if E < E_all else (True,):
                sets = routings(T, K, E, E_all, busy, dev)
                ws = [torch.rand(T, K, device=dev) for _ in sets]
                x = torch.randn(T, D, device=dev).to(BF)
                route = "" if E == E_all else (" busy" if busy else " random")
                n_all = 0 if busy else E_all  # EP: the engine's expert count (tiles for the pairs a rank owns)
                n_exp = sum(int(ids[ids < E].unique().numel()) for ids in sets) / len(sets)
                nbytes = n_exp * expert_bytes(D, I) + x.numel() * 2
                default = default_form(T * K, E, num_experts=n_all)
                forms = ("gemv", "gemm") if T in both else (default,)
                if "gemv" in forms and dev == "cuda":
                    forms = ("gemv_mma", "gemv_fma") + forms[1:]
                    if default == "gemv":
                        default = "gemv_mma" if mma_preferred(D, I, T * K) else "gemv_fma"
                if only_forms:
                    forms = tuple(f for f in forms if f in only_forms)
                ref = int4_fused_experts_ref(x.float(), *w, ws[0], sets[0], 0) if T <= 8 or dev != "cuda" else None
                variants = [(f, {}, "") for f in forms]
                if "gemv_mma" in forms and 1 < T <= 8:  # pairs of one expert apart
                    variants += [("gemv_mma", dict(pair=False), " unpaired")]
                for form, extra, tag in variants:
                    if form == "gemv_mma":
                        cfgs = mma_config(D, I, T * K, T * K * E / (n_all or E))
                    else:
                        cfgs = gemv_config(D, I, T * K) if form.startswith("gemv") else gemm_config(T, K, E, D, I, BF)
                    cfg = dict(form=form, **extra)
                    out = int4_fused_experts(x, *w, ws[0], sets[0], 0, all_local=busy, config=cfg, num_experts=n_all)
                    if ref is None and not bf16:
                        err = float("nan")
                    else:
                        err = rel(out, ref if ref is not None else fused_experts(x, w13, w2, ws[0], sets[0], 0))
                    calls = list(zip(sets, ws))
                    ms = bench(
                        lambda f=cfg, c=calls: [  # noqa: B023
                            int4_fused_experts(x, *w, tw, ids, 0, all_local=busy, config=f, num_experts=n_all)
                            for ids, tw in c
                        ],
                        sz,
                    ) / len(calls)
                    star = "*" if form == default and not extra else ""
                    rep.add(
                        "int4_moe",
                        f"{name}{route} T={T} {form}{star}{tag} experts={n_exp:.0f} "
                        f"{cfg_label(cfgs[0])} | {cfg_label(cfgs[1])}",
                        ms,
                        nbytes,
                        err=err,
                        shape=name,
                        T=T,
                        form=form + tag.replace(" ", "_"),
                        default=bool(star),
                        route=route.strip() or None,
                        experts=n_exp,
                        config=[{k: str(v) for k, v in c.items()} for c in cfgs],
                    )
                if bf16:
                    calls = list(zip(sets, ws))
                    ms = bench(lambda c=calls: [fused_experts(x, w13, w2, tw, ids, 0) for ids, tw in c], sz)
                    rep.add(
                        "int4_moe",
                        f"{name}{route} T={T} bf16 fused_experts (same weights)",
                        ms / len(calls),
                        n_exp * 3 * D * I * 2 + x.numel() * 2,
                        shape=name,
                        T=T,
                        form="bf16",
                        route=route.strip() or None,
                        experts=n_exp,
                    )
                if T <= 2 and busy:
                    _gemv_rows(rep, sz, name, T, K, x, w, sets, ws, nbytes, sweeps)
                if T <= 8 and busy and dev == "cuda":
                    _mma_rows(rep, sz, name, T, K, x, w, sets, ws, nbytes)
        if name in ("kimi", "tiny") and sweeps and bf16:
            _sweeps(rep, sz, name, D, I, E, K, w, w13, w2)
            _anchor(rep, sz, D, I)
        w = w13 = w2 = None
        if dev == "cuda":
            torch.cuda.empty_cache()


def _gemv_rows(rep, sz, name, T, K, x, w, sets, ws, nbytes, sweep=True):
    """The two GEMV launches alone (preallocated buffers, no sum), default tiles then GEMV1/GEMV2_SWEEP."""
    from mlaserve.kernels.int4_gemv import int4_gemv
    from mlaserve.kernels.int4_moe import gemv_config
    from mlaserve.kernels.pdl import pdl_args

    D, I = x.shape[1], w[0].shape[1] // 2
    hbuf = torch.empty(T * K, I, dtype=BF, device=sz.dev)
    y = torch.empty(T * K, D, dtype=BF, device=sz.dev)
    c1, c2 = gemv_config(D, I, T * K)
    variants = [(c1, c2)] + [(dict(c1, **v), c2) for v in GEMV1_SWEEP[1:]]
    variants += [(c1, gemv2_variant(v, D, I, T * K)) for v in GEMV2_SWEEP[1:]]
    if T > 1 or sz.dev != "cuda" or not sweep:
        variants = variants[: 1 if T > 1 or not sweep else 2]
    for v1, v2 in variants:
        try:
            ms = bench(
                lambda a=v1, b=v2: [  # noqa: B023
                    int4_gemv(x, *w, tw, ids, 0, hbuf, y, pdl_args(x), a, b) for ids, tw in zip(sets, ws)
                ],
                sz,
            ) / len(sets)
            rep.add(
                "int4_gemv",
                f"{name} T={T} gemv kernels {cfg_label(v1)} | {cfg_label(v2)}",
                ms,
                nbytes,
                shape=name,
                T=T,
                config=[{k: str(val) for k, val in c.items()} for c in (v1, v2)],
            )
        except Exception as e:  # e.g. out of registers
            print(f"int4 gemv {v1} {v2}: {type(e).__name__}: {str(e)[:160]}")


def _mma_rows(rep, sz, name, T, K, x, w, sets, ws, nbytes):
    """The tensor-core GEMV's two launches alone (preallocated buffers, no sum): default tiles; at one token
    MMA_SWEEP's variants, then the fastest gemv1 with the fastest gemv2 (also at 2 and 8 tokens)."""
    from mlaserve.kernels.int4_gemv import int4_gemv
    from mlaserve.kernels.int4_mma_run import int4_gemv_mma
    from mlaserve.kernels.int4_moe import gemv_config
    from mlaserve.kernels.pdl import pdl_args

    D, I = x.shape[1], w[0].shape[1] // 2
    hbuf = torch.empty(T * K, I, dtype=BF, device=sz.dev)
    y = torch.empty(T * K, D, dtype=BF, device=sz.dev)

    def run(v1, v2, fma=False):
        fn = int4_gemv if fma else int4_gemv_mma
        try:
            ms = bench(
                lambda: [fn(x, *w, tw, ids, 0, hbuf, y, pdl_args(x), v1, v2) for ids, tw in zip(sets, ws)], sz
            ) / len(sets)
        except Exception as e:  # e.g. out of registers
            print(f"int4 {'fma' if fma else 'mma'} {v1} {v2}: {type(e).__name__}: {str(e)[:160]}")
            return float("inf")
        rep.add(
            "int4_gemv" if fma else "int4_mma",
            f"{name} T={T} {'gemv' if fma else 'mma'} kernels {cfg_label(v1)} | {cfg_label(v2)}",
            ms,
            nbytes,
            shape=name,
            T=T,
            config=[{k: str(val) for k, val in c.items()} for c in (v1, v2)],
        )
        return ms

    table = MMA_SWEEP if os.environ.get("INT4_BENCH_SWEEPS", "1") != "0" else MMA_QUICK
    variants = mma_variants(D, I, T * K, sweep=T == 1 and (D, I) not in MMA_BEST, table=table)
    times = [run(v1, v2) for v1, v2 in variants]
    if len(variants) > 1:
        c1, c2 = variants[0]
        b1 = min((t, i) for i, (t, v) in enumerate(zip(times, variants)) if v[1] is c2)[1]
        b2 = min((t, i) for i, (t, v) in enumerate(zip(times, variants)) if v[0] is c1)[1]
        MMA_BEST[(D, I)] = (variants[b1][0], variants[b2][1])
        if (D, I) == (7168, 2048) and table is MMA_SWEEP:
            f1, f2 = gemv_config(D, I, T * K)
            for o1, o2 in FMA_EXTRA:
                run(dict(f1, **o1), dict(f2, **o2), fma=True)
    if (D, I) in MMA_BEST and MMA_BEST[(D, I)] not in variants:
        print(f"int4 mma best {name}: {MMA_BEST[(D, I)]}")
        run(*MMA_BEST[(D, I)])


def _sweeps(rep, sz, name, D, I, E, K, w, w13, w2):
    """GEMM tiles at the prefill chunk (the whole int4_fused_experts, against the bf16 fused_experts' output)."""
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.int4_moe import int4_fused_experts

    T = 2048 if sz.dev == "cuda" else 5
    ids = torch.rand(T, E, device=sz.dev).topk(K, -1).indices
    tw = torch.rand(T, K, device=sz.dev)
    x = torch.randn(T, D, device=sz.dev).to(BF)
    base = fused_experts(x, w13, w2, tw, ids, 0)
    nbytes = int(ids.unique().numel()) * expert_bytes(D, I) + x.numel() * 2
    t0 = time.time()
    for c in GEMM_SWEEP if sz.dev == "cuda" else GEMM_SWEEP[:1]:
        if time.time() - t0 > 120:
            break
        cfg = dict(form="gemm", gemm1=c, gemm2=c)
        try:
            err = rel(int4_fused_experts(x, *w, tw, ids, 0, config=cfg), base)
            ms = bench(lambda cfg=cfg: int4_fused_experts(x, *w, tw, ids, 0, config=cfg), sz)
            flops = 6.0 * T * K * D * I
            rep.add("int4_sweep", f"{name} T={T} gemm {cfg_label(c)}", ms, nbytes, flops, err=err, config=c)
        except Exception as e:
            print(f"int4 gemm {c}: {type(e).__name__}: {str(e)[:160]}")


def _anchor(rep, sz, D, I):
    """torch's INT4 weight-only GEMV (tinygemm, group 32) at one row, N = I and N = 8 experts' gate|up rows."""
    if sz.dev != "cuda":
        return
    for N in (I, 8 * 2 * I):
        try:
            wq = torch.randint(0, 256, (N, D // 2), dtype=torch.uint8, device="cuda")
            packed = torch._convert_weight_to_int4pack(wq, 8)
            sz_ = torch.rand(D // 32, N, 2, device="cuda").to(BF)
            x = torch.randn(1, D, device="cuda").to(BF)
            ms = bench(lambda p=packed, s=sz_: torch._weight_int4pack_mm(x, p, 32, s), sz)  # noqa: B023
            rep.add("int4_anchor", f"torch _weight_int4pack_mm M=1 K={D} N={N}", ms, N * D // 2 + sz_.numel() * 2)
        except Exception as e:
            print(f"int4 anchor N={N}: {type(e).__name__}: {str(e)[:200]}")
