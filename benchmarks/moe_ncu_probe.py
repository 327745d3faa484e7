"""The batch-1 fused MoE (M1: Moonlight's 64 experts top-6 plus 2 shared slots, D 2048, I 1408) as decode reads
it, layer after layer: why GEMM1 / GEMM2 stream at ~70 % of the bandwidth in the engine and 78 % in kernels_bench.

    PYTHONPATH=$PWD python benchmarks/moe_ncu_probe.py [--tma 0|1] [--reps 40] [--stages 3,3] [--lm-head]  # eager
    PYTHONPATH=$PWD python benchmarks/moe_ncu_probe.py --sweep [--layers 26]           # CUDA graphs, variants
    PYTHONPATH=$PWD python benchmarks/moe_ncu_probe.py --chain --layers 26 --reps 20   # after the router, PDL on/off
    PYTHONPATH=$PWD python benchmarks/moe_ncu_probe.py --prefetch --layers 26 --reps 20  # shared experts into L2
    ncu --kernel-name regex:_moe_gemm --launch-skip 16 --launch-count 4 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis_Chart \\
        python3 benchmarks/moe_ncu_probe.py --reps 3                                  # the counters

--sweep captures one graph of `--layers` layers' MoE (each layer its own weights, the engine's footprint at 26) and
times its replays, per variant: the experts fixed (as kernels_bench) or drawn afresh for every layer before every
replay (as decode routes), TMA tiles or pointer loads, other tiles. One replay is profiled per kernel.
--chain and --prefetch put an attention stand-in before each layer's MoE (chain_sweep, prefetch_sweep).
Session 9's results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlaserve.kernels.fused_moe import fused_experts  # noqa: E402
from mlaserve.kernels.pdl import pdl_args, pdl_release, pdl_wait  # noqa: E402

BF = torch.bfloat16
D, I, E, K, S = 2048, 1408, 64, 6, 2
GB = (K + S) * 3 * I * D * 2 / 1e9  # the 8 experts' gate, up and down weights read by one layer at T=1


# The L2 prefetch tried in session 9 (--prefetch): measured no gain, so it stays here, not in the engine.
PF_CHUNK = 16 << 10  # bytes a bulk prefetch; 34.6 MB of Moonlight's shared experts -> ~2.1k chunks, 67 programs


def prefetch_plan(tensors: list[torch.Tensor], chunk: int = PF_CHUNK) -> torch.Tensor:
    """[n, 2] int64 (address, bytes) covering each contiguous tensor in 16-byte-aligned chunks of <= chunk."""
    rows = []
    for t in tensors:
        start, nbytes = t.data_ptr(), t.numel() * t.element_size()
        lo, hi = start // 16 * 16, -(-(start + nbytes) // 16) * 16
        rows += [(a, min(chunk, hi - a)) for a in range(lo, hi, chunk)]
    return torch.tensor(rows, dtype=torch.int64, device=tensors[0].device)


@triton.jit
def _l2_prefetch_kernel(Plan, n, PER_PROG: tl.constexpr, PDL: tl.constexpr):
    """One `cp.async.bulk.prefetch.L2.global` of one plan chunk per thread, before the PDL wait (weights only)."""
    pdl_release(PDL)
    i = tl.program_id(0) * PER_PROG + tl.arange(0, PER_PROG)
    ok = i < n
    addr = tl.load(Plan + 2 * i, mask=ok, other=0)
    nbytes = tl.load(Plan + 2 * i + 1, mask=ok, other=0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addr, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    pdl_wait(PDL)


def l2_prefetch(plan: torch.Tensor) -> None:
    n = plan.shape[0]
    _l2_prefetch_kernel[(triton.cdiv(n, 32),)](plan, n, PER_PROG=32, num_warps=1, **pdl_args(plan))


def weights(L: int, g: torch.Generator):
    def rnd(*shape, fan):
        return torch.empty(*shape, device="cuda", dtype=BF).normal_(0, fan**-0.5, generator=g)

    return [
        (
            rnd(E, 2 * I, D, fan=D),
            rnd(E, D, I, fan=I),
            (rnd(S * I, D, fan=D), rnd(S * I, D, fan=D), rnd(D, S * I, fan=S * I)),
        )
        for _ in range(L)
    ]


def draw_ids(L: int, n: int, g: torch.Generator, routed_only: bool = False) -> torch.Tensor:
    """[n, L, 1, K + S]: K distinct routed experts per layer, then the shared slots E, E+1; routed_only: K + S
    distinct routed experts (the same bytes, no shared slots)."""
    if routed_only:
        return torch.rand(n, L, E, device="cuda", generator=g).argsort(-1)[..., : K + S][:, :, None].contiguous()
    routed = torch.rand(n, L, E, device="cuda", generator=g).argsort(-1)[..., :K]
    shared = torch.arange(E, E + S, device="cuda").expand(n, L, S)
    return torch.cat([routed, shared], -1)[:, :, None].contiguous()


def time_graph(ws, cfg, random_ids: bool, reps: int, g) -> dict:
    """cfg: fused_experts' config, plus "routed_only": the 8 experts all routed (K + S distinct routed ids, no
    shared slots), the same bytes without the shared-slot branch (whose second weight pipeline doubles the
    kernels' shared memory: compile_check)."""
    L = len(ws)
    cfg = dict(cfg or {})
    routed_only = cfg.pop("routed_only", False)
    x = torch.randn(L, 1, D, device="cuda", generator=g).to(BF)
    w = torch.cat([torch.rand(L, 1, K, device="cuda", generator=g), torch.ones(L, 1, S, device="cuda")], -1)
    bank = draw_ids(L, reps if random_ids else 1, g, routed_only)
    ids = bank[0].clone()

    def layer(i):
        w13, w2, sh = ws[i]
        fused_experts(x[i], w13, w2, w[i], ids[i], 0, config=cfg or None, shared=None if routed_only else sh)

    graph = capture(layer, L)
    times = replays(graph, L, ids, bank, reps)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and "_moe" in ev.name:
            n = ev.name.split("(")[0]
            per.setdefault(n, []).append(ev.device_time)
    med = times[len(times) // 2]
    return dict(us=med, best=times[0], tbps=GB / med * 1e3, kernels={n: sum(v) / len(v) for n, v in per.items()})


def sweep(a) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = weights(a.layers, g)
    t2 = dict(tma=True)
    variants = [
        ("default, fixed experts", None, False),
        ("default, fresh experts", None, True),
        ("pointer loads", dict(tma=False), True),
        ("tma g1 s3 g2 s4", dict(t2, gemm1=dict(num_stages=3), gemm2=dict(num_stages=4)), True),
        ("tma g1 N16 s3", dict(t2, gemm1=dict(BLOCK_N=16, num_stages=3)), True),
        ("tma g1 N64 s2", dict(t2, gemm1=dict(BLOCK_N=64, num_stages=2)), True),
        ("tma g1 K256 s2", dict(t2, gemm1=dict(BLOCK_K=256, num_stages=2)), True),
        ("tma g2 N32 s3", dict(t2, gemm2=dict(BLOCK_N=32, num_stages=3)), True),
        ("tma g2 N128 s2", dict(t2, gemm2=dict(BLOCK_N=128, num_stages=2)), True),
        ("tma g2 K256 s2", dict(t2, gemm2=dict(BLOCK_K=256, num_stages=2)), True),
        ("tma w8 both", dict(t2, num_warps=8), True),
        # session 11: is the stage count held back by the shared-slot branch's second pipeline (2x shared memory)?
        ("routed-only default", dict(routed_only=True), True),
        (
            "routed-only g1 s3 g2 s4",
            dict(t2, routed_only=True, gemm1=dict(num_stages=3), gemm2=dict(num_stages=4)),
            True,
        ),
        (
            "routed-only g1 s4 g2 s4",
            dict(t2, routed_only=True, gemm1=dict(num_stages=4), gemm2=dict(num_stages=4)),
            True,
        ),
        ("routed-only g1 s4 g2 s3", dict(t2, routed_only=True, gemm1=dict(num_stages=4)), True),
    ]
    if a.only:
        variants = [v for v in variants if any(s in v[0] for s in a.only.split(","))]
    floor = GB / 4.3 * 1e3
    print(
        f"M1 MoE T=1, {a.layers} layers' weights; floor {floor:.1f} us a layer (gemm1 {floor * 2 / 3:.1f}, "
        f"gemm2 {floor / 3:.1f})"
    )
    print(
        f"{'variant':28s} {'us/layer':>9s} {'best':>7s} {'% bw':>5s}  gemm1 / gemm2 / sum, profiled us "
        "(under PDL each includes its wait)"
    )
    rows = []
    for name, cfg, rnd in variants:
        try:
            r = time_graph(ws, cfg, rnd, a.reps, g)
        except Exception as e:  # a tile that does not fit: report, go on
            print(f"{name:28s} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        k = r["kernels"]
        parts = " / ".join(f"{v:.1f}" for n, v in sorted(k.items()))
        print(f"{name:28s} {r['us']:9.1f} {r['best']:7.1f} {100 * r['tbps'] / 4.3:4.0f}%  {parts}")
        rows.append(dict(variant=name, config=cfg, random_ids=rnd, **r))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_probe_sweep.json"), "w") as f:
            json.dump(dict(layers=a.layers, floor_us=floor, rows=rows), f, indent=1)


def prefetch_sweep(a) -> None:
    """Each layer: an attention stand-in (an 8 MB GEMV by cuBLAS, then a spin of --window-us), then the MoE; the
    shared experts' weights prefetched into L2 (l2_prefetch) before the window, after it, or not at all. The MoE's
    time is the layer's minus the stand-in's alone (with the prefetch launch when it has one)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = weights(a.layers, g)
    L = a.layers
    o_w = [torch.empty(D, D, device="cuda", dtype=BF).normal_(0, D**-0.5, generator=g) for _ in range(L)]
    h = torch.randn(1, D, device="cuda", generator=g).to(BF)
    x = torch.randn(L, 1, D, device="cuda", generator=g).to(BF)
    w = torch.cat([torch.rand(L, 1, K, device="cuda", generator=g), torch.ones(L, 1, S, device="cuda")], -1)
    bank = draw_ids(L, a.reps, g)
    ids = bank[0].clone()
    plans = {
        "g1+g2": [prefetch_plan([sh[0], sh[1], sh[2]]) for _, _, sh in ws],
        "g1": [prefetch_plan([sh[0], sh[1]]) for _, _, sh in ws],
    }
    cycles = int(a.window_us * 1.98e3)

    def layer(i, pf, where, moe):
        if pf and where == "early":
            l2_prefetch(plans[pf][i])
        torch.nn.functional.linear(h, o_w[i])
        torch.cuda._sleep(cycles)
        if pf and where == "late":
            l2_prefetch(plans[pf][i])
        if moe:
            w13, w2, sh = ws[i]
            fused_experts(x[i], w13, w2, w[i], ids[i], 0, shared=sh)

    print(
        f"prefetch: {L} layers, window = 8 MB GEMV + {a.window_us} us spin; MoE floor {GB / 4.3 * 1e3:.1f} us, "
        f"without the shared experts {GB * K / (K + S) / 4.3 * 1e3:.1f} us"
    )
    rows = []
    for pf in (None, "g1+g2", "g1"):
        for where in (None,) if pf is None else ("early", "late"):
            base = time_layers(lambda i, pf=pf, where=where: layer(i, pf, where, False), L, ids, bank, a.reps)
            full = time_layers(lambda i, pf=pf, where=where: layer(i, pf, where, True), L, ids, bank, a.reps)
            rows.append(moe_row("none" if pf is None else f"{pf} {where}", base, full, prefetch=pf, where=where))
    dump("moe_probe_prefetch.json", a, rows)


def capture(layer, L: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of layer(i) for i < L (run once eagerly first: compiles), replayed thrice to warm up."""

    def step():
        for i in range(L):
            layer(i)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    return graph


def replays(graph, L: int, ids: torch.Tensor, bank: torch.Tensor, reps: int, before=None) -> list[float]:
    """Sorted us a layer of `reps` replays; ids refilled from bank (and `before()` run) ahead of each."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    t = []
    for r in range(reps):
        ids.copy_(bank[r % bank.shape[0]])
        if before:
            before()
        ev[0].record()
        graph.replay()
        ev[1].record()
        ev[1].synchronize()
        t.append(ev[0].elapsed_time(ev[1]) * 1e3 / L)
    return sorted(t)


def moe_row(name: str, base: float, full: float, **keys) -> dict:
    """Print and return one row: the layer's us with the MoE (full) and without it (base)."""
    moe = full - base
    print(
        f"{name:22s} layer {full:7.1f} us, without the MoE {base:6.1f}, MoE {moe:6.1f} us "
        f"({100 * GB / moe * 1e3 / 4.3:.0f} % of 4.3 TB/s)"
    )
    return dict(keys, layer_us=full, base_us=base, moe_us=moe)


def dump(name: str, a, rows: list) -> None:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(dict(layers=a.layers, window_spin_us=a.window_us, rows=rows), f, indent=1)


def time_layers(layer, L: int, ids: torch.Tensor, bank: torch.Tensor, reps: int, before=None) -> float:
    """Median us a layer over replays of one graph of layer(i) for i < L."""
    t = replays(capture(layer, L), L, ids, bank, reps, before)
    return t[len(t) // 2]


def chain_sweep(a) -> None:
    """Each layer: an attention stand-in (an 8 MB GEMV by cuBLAS, then a spin of --window-us), then optionally the
    decode router (router partials + routing, as the engine runs them), then the MoE with the add + RMSNorm fused
    into its sum, as the engine runs it. The MoE's time is the layer's minus the same layer without it; with the
    routing kernels before it, the MoE waits on them through PDL (in the engine), with fixed experts not."""
    from mlaserve.kernels import pdl
    from mlaserve.kernels.routing import route_splitk

    g = torch.Generator(device="cuda").manual_seed(0)
    ws = weights(a.layers, g)
    L = a.layers
    o_w = [torch.empty(D, D, device="cuda", dtype=BF).normal_(0, D**-0.5, generator=g) for _ in range(L)]
    r_w = [torch.empty(E, D, device="cuda", dtype=BF).normal_(0, D**-0.5, generator=g) for _ in range(L)]
    bias = torch.zeros(E, device="cuda")
    h = torch.randn(1, D, device="cuda", generator=g).to(BF)
    x = torch.randn(L, 1, D, device="cuda", generator=g).to(BF)
    res = torch.randn(L, 1, D, device="cuda", generator=g).to(BF)
    nw = torch.ones(D, device="cuda", dtype=BF)
    w = torch.cat([torch.rand(L, 1, K, device="cuda", generator=g), torch.ones(L, 1, S, device="cuda")], -1)
    bank = draw_ids(L, a.reps, g)
    ids = bank[0].clone()
    cycles = int(a.window_us * 1.98e3)

    def layer(i, route, moe):
        torch.nn.functional.linear(h, o_w[i])
        torch.cuda._sleep(cycles)
        tw, ti = route_splitk(x[i], r_w[i], bias, K, 1, 1, True, 2.446, S, E) if route else (w[i], ids[i])
        if moe:
            w13, w2, sh = ws[i]
            fused_experts(x[i], w13, w2, tw, ti, 0, shared=sh, norm=(nw, 1e-6, res[i]))

    print(f"chain: {L} layers, window = 8 MB GEMV + {a.window_us} us spin; MoE floor {GB / 4.3 * 1e3:.1f} us")
    rows = []
    # PDL on with GEMM2's early reads (fused_moe PREWAIT), on without them, off; twice, interleaved
    variants = [(True, "1"), (True, "0"), (False, "1")] * 2
    for pdl_on, prewait in variants:
        pdl._pdl_on = (lambda i: torch.cuda.get_device_capability(i)[0] >= 9) if pdl_on else (lambda i: False)
        os.environ["MLASERVE_MOE_PREWAIT"] = prewait
        for route in (False, True):
            base, full = (
                time_layers(
                    lambda i, route=route, moe=moe: layer(i, route, moe),
                    L,
                    ids,
                    bank,
                    a.reps,
                    lambda: x.normal_(generator=g),
                )
                for moe in (False, True)
            )  # fresh routes
            name = (
                f"{'routed' if route else 'fixed ids'}, PDL {'on' if pdl_on else 'off'}"
                f"{', GEMM2 prewait' if pdl_on and prewait == '1' else ''}"
            )
            rows.append(moe_row(name, base, full, pdl=pdl_on, routed=route, prewait=pdl_on and prewait == "1"))
    os.environ.pop("MLASERVE_MOE_PREWAIT")
    dump("moe_probe_chain.json", a, rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tma", type=int, default=None, help="force TMA weight tiles on (1) or off (0)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="graph-timed variants (see the docstring)")
    ap.add_argument("--only", default="", help="--sweep: variants whose name contains one of these (comma list)")
    ap.add_argument("--chain", action="store_true", help="the MoE after the router, as the engine (chain_sweep)")
    ap.add_argument("--prefetch", action="store_true", help="L2 prefetch of the shared experts (prefetch_sweep)")
    ap.add_argument("--window-us", type=float, default=10.0)
    ap.add_argument(
        "--stages",
        default="",
        help="eager mode: GEMM1,GEMM2 num_stages (e.g. 3,3) for an ncu comparison with the default 2,3",
    )
    ap.add_argument(
        "--lm-head",
        action="store_true",
        help="eager mode: also run M1's lm_head GEMV (cuBLAS, "
        "163840 x 2048 bf16), the streaming kernel the MoE's rate is compared with",
    )
    a = ap.parse_args()
    if a.chain:
        return chain_sweep(a)
    if a.prefetch:
        return prefetch_sweep(a)
    if a.sweep:
        return sweep(a)
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = weights(a.layers, g)
    x = torch.randn(1, D, device="cuda", generator=g).to(BF)
    ids = draw_ids(1, 1, g)[0, 0]
    w = torch.cat([torch.rand(1, K, device="cuda", generator=g), torch.ones(1, S, device="cuda")], 1)
    cfg = {} if a.tma is None else dict(tma=bool(a.tma))
    if a.stages:
        s1, s2 = (int(v) for v in a.stages.split(","))
        cfg.update(gemm1=dict(num_stages=s1), gemm2=dict(num_stages=s2))
    cfg = cfg or None
    if a.lm_head:  # 671 MB: cuBLAS streams it at ~4.3 TB/s in the engine (bench_engine --profile)
        head = torch.empty(163840, D, device="cuda", dtype=BF).normal_(0, D**-0.5, generator=g)
        for _ in range(3):
            torch.nn.functional.linear(x, head)
    run = [
        lambda w13=w13, w2=w2, sh=sh: fused_experts(x, w13, w2, w, ids, 0, config=cfg, shared=sh) for w13, w2, sh in ws
    ]
    for f in run:  # compile, warm up
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.reps):
        for f in run:
            f()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (a.reps * len(run))
    print(
        f"fused MoE T=1 (tma={a.tma}), eager: {us:.1f} us a layer, {GB / us * 1e3:.2f} TB/s "
        f"({100 * GB / us * 1e3 / 4.3:.0f} % of 4.3 TB/s)"
    )


if __name__ == "__main__":
    main()
