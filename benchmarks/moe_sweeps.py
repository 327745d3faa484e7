"""kernels_bench's fused-MoE sweeps (sections moe_sweep, moe_layers, moe_shared, moe_norm): tile configs across
shapes and batch sizes, the MoE over several layers' weights in turn, the shared-experts fusion and the fused sum +
norm against their unfused forms.

    PYTHONPATH=$PWD python benchmarks/kernels_bench.py --only moe_sweep,moe_layers,moe_shared,moe_norm
"""

from __future__ import annotations

import time

import torch

from benchmarks.bench_util import BF, Report, Sizes, bench, cfg_label, moe_inputs, rel

MOE_DECODE_CFGS = [
    dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4),
    dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3),
    dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5),
    dict(BLOCK_N=64, BLOCK_K=64, num_warps=2, num_stages=6),
    dict(BLOCK_N=64, BLOCK_K=256, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
]
MOE_PREFILL_GEMM1 = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=32, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=5),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
]  # M: both GEMMs
MOE_PREFILL_GEMM2 = [
    dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=5),
    dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=4),
    dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=32, num_warps=4, num_stages=4),
]


def run_moe_sweep(rep: Report, sz: Sizes):
    """Tile alternatives on sz.moe_sweep_shapes: decode T in sz.moe_sweep_decode_T (flat configs, plus no_align
    on/off), then the prefill T=max(moe_T) with gemm1 and gemm2 configs swept separately (timed through the whole
    fused_experts). Stops adding cases after sz.moe_sweep_budget_s seconds (compiles dominate: ~1-2 s each)."""
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.moe_config import moe_config

    t0 = time.time()
    for name in sz.moe_sweep_shapes:
        D, I, E, K = sz.moe[name]
        w13 = (torch.randn(E, 2 * I, D, device=sz.dev) / D**0.5).to(BF)
        w2 = (torch.randn(E, D, I, device=sz.dev) / I**0.5).to(BF)
        Tp = max(sz.moe_T)
        cases = [(T, "default", None) for T in sz.moe_sweep_decode_T]
        cases += [(T, f"no_align={v}", dict(no_align=v)) for T in sz.moe_sweep_decode_T[:2] for v in (True, False)]
        n = sz.moe_sweep_max_cfgs
        cases += [(T, cfg_label(c), c) for c in MOE_DECODE_CFGS[:n] for T in sz.moe_sweep_decode_T]
        d1, d2 = moe_config(Tp, K, E, D, I, BF)
        cases += [(Tp, f"default g1 [{cfg_label(d1)}] g2 [{cfg_label(d2)}]", None)]
        cases += [(Tp, f"gemm1 {cfg_label(c)}", dict(gemm1=c)) for c in MOE_PREFILL_GEMM1[:n]]
        cases += [(Tp, f"gemm2 {cfg_label(c)}", dict(gemm2=c)) for c in MOE_PREFILL_GEMM2[:n]]
        inputs = {}
        for T, label, cfg in cases:
            if time.time() - t0 > sz.moe_sweep_budget_s:
                print(f"moe_sweep: {sz.moe_sweep_budget_s:.0f} s budget spent; skipping {name} T={T} {label}")
                continue
            if T not in inputs:
                inputs[T] = moe_inputs(T, D, E, K, sz.dev)
            x, ids, w = inputs[T]
            n_exp = int(ids.unique().numel())
            decode = T <= 64
            try:
                ms = bench(lambda: fused_experts(x, w13, w2, w, ids, 0, config=cfg), sz)  # noqa: B023
                rep.add(
                    "moe_sweep",
                    f"{name} T={T} {label}",
                    ms,
                    n_exp * 3 * D * I * 2 if decode else 0.0,
                    0.0 if decode else 6.0 * T * K * D * I,
                    config=cfg,
                    shape=name,
                    T=T,
                )
            except Exception as e:  # e.g. out of shared memory
                print(f"moe_sweep {name} T={T} {label}: {type(e).__name__}: {str(e)[:120]}")
        w13 = w2 = inputs = None
        if sz.dev == "cuda":
            torch.cuda.empty_cache()


# decode MoE (few rows): the weights of sz.layers layers in turn, timed per layer, so every layer's weights come
# from HBM as in the engine (one layer's weights replayed alone could partly stay in the 50 MB L2)
MOE_LAYER_CFGS = [
    dict(gemm2=dict(BLOCK_N=32)),
    dict(gemm1=dict(BLOCK_N=32), gemm2=dict(BLOCK_N=32)),
    dict(num_stages=6),
    dict(BLOCK_K=256, num_stages=3),
    dict(num_warps=2, BLOCK_K=128, num_stages=5),
    dict(num_warps=8, BLOCK_K=256, num_stages=4),
    dict(gemm2=dict(BLOCK_N=16, BLOCK_K=256)),
]


def run_moe_layers(rep: Report, sz: Sizes):
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref

    L = sz.layers
    for name, (D, I, E, K) in list(sz.moe.items())[:1]:
        w13 = [(torch.randn(E, 2 * I, D, device=sz.dev) / D**0.5).to(BF) for _ in range(L)]
        w2 = [(torch.randn(E, D, I, device=sz.dev) / I**0.5).to(BF) for _ in range(L)]
        for T in sz.layers_T:
            x, ids, w = moe_inputs(T, D, E, K, sz.dev)
            n_exp = int(ids.unique().numel())
            ref = fused_experts_ref(x.float(), w13[0].float(), w2[0].float(), w, ids, 0)
            for cfg in [None] + MOE_LAYER_CFGS:
                try:
                    err = rel(fused_experts(x, w13[0], w2[0], w, ids, 0, config=cfg), ref)
                    ms = (
                        bench(
                            lambda c=cfg: [
                                fused_experts(x, w13[i], w2[i], w, ids, 0, config=c)  # noqa: B023
                                for i in range(L)
                            ],
                            sz,
                        )
                        / L
                    )
                    rep.add(
                        "moe_layers",
                        f"{name} T={T} {cfg_label(cfg) if cfg else 'default'}",
                        ms,
                        n_exp * 3 * D * I * 2,
                        err=err,
                        T=T,
                        config=cfg,
                        layers=L,
                    )
                except Exception as e:  # e.g. out of shared memory
                    print(f"moe_layers {name} T={T} {cfg}: {type(e).__name__}: {str(e)[:120]}")
            ref = None
        w13 = w2 = None
        if sz.dev == "cuda":
            torch.cuda.empty_cache()


def run_moe_shared(rep: Report, sz: Sizes):
    """The whole MoE block (router GEMM, routing, experts, shared experts) with the shared experts fused into the
    Triton MoE (DeepseekV3MoE.fuse_shared) against unfused (cuBLAS gate|up, SiLU, down, added in the MoE sum),
    timed per layer over sz.layers layers' weights in turn; err: fused against unfused."""
    from mlaserve.config import ModelConfig
    from mlaserve.distributed.tp import RankInfo
    from mlaserve.models.deepseek_v3 import DeepseekV3MoE
    from mlaserve.models.dummy_weights import init_dummy_weights
    from mlaserve.models.make_random import load_preset

    cfg = ModelConfig.from_hf(load_preset(sz.shared_preset))
    with torch.device(sz.dev):
        layers = [DeepseekV3MoE(cfg, RankInfo(), BF, "triton") for _ in range(sz.layers)]
    for i, layer in enumerate(layers):
        init_dummy_weights(layer, seed=i)
    S = layers[0].fuse_shared
    for T in sz.shared_T:
        x = torch.randn(T, cfg.hidden_size, device=sz.dev).to(BF)
        unfused = None
        for fused in (False, True):
            for layer in layers:
                layer.fuse_shared = S if fused else 0
                out = layer(x)  # compiles, and the router's one-time bf16 check (a host sync) before capture
            unfused = out if unfused is None else unfused
            ms = bench(lambda: [layer(x) for layer in layers], sz) / len(layers)  # noqa: B023
            rep.add(
                "moe_shared",
                f"{sz.shared_preset} T={T} S={S} {'fused' if fused else 'unfused'}",
                ms,
                err=rel(out, unfused) if fused else None,
                T=T,
                fused=fused,
                layers=len(layers),
            )
    layers = None
    if sz.dev == "cuda":
        torch.cuda.empty_cache()


def run_moe_norm(rep: Report, sz: Sizes):
    """The add + RMSNorm after the MoE fused into its sum over top-k (one kernel) against the sum then add_rms_norm
    (two): the kernels alone on the moe shapes' per-(token, k) rows, then the MoE block plus the norm after it
    (DeepseekV3MoE(x, norm, residual), fuse_norm on/off) per layer over sz.layers layers' weights in turn.
    err: fused against unfused (0: bit-equal, as it must be)."""
    from mlaserve.config import ModelConfig
    from mlaserve.distributed.tp import RankInfo
    from mlaserve.kernels.moe_sum import moe_sum
    from mlaserve.kernels.rmsnorm import add_rms_norm
    from mlaserve.layers.norm import RMSNorm
    from mlaserve.models.deepseek_v3 import DeepseekV3MoE
    from mlaserve.models.dummy_weights import init_dummy_weights
    from mlaserve.models.make_random import load_preset

    for name, (D, _, E, K) in sz.moe.items():
        w = (1 + 0.1 * torch.randn(D, device=sz.dev)).to(BF)
        for T in sz.norm_T:
            y, ids = torch.randn(T * K, D, device=sz.dev).to(BF), torch.rand(T, E, device=sz.dev).topk(K, -1).indices
            res, add = torch.randn(T, D, device=sz.dev).to(BF), torch.randn(T, D, device=sz.dev).to(BF)
            ref = add_rms_norm(moe_sum(y, ids, 0, E, add), res, w, 1e-6)
            err = rel(moe_sum(y, ids, 0, E, add, norm=(w, 1e-6, res))[0], ref[0])
            for fused in (False, True):
                fn = (
                    (lambda: moe_sum(y, ids, 0, E, add, norm=(w, 1e-6, res)))
                    if fused
                    # noqa: B023
                    else (lambda: add_rms_norm(moe_sum(y, ids, 0, E, add), res, w, 1e-6))
                )  # noqa: B023
                rep.add(
                    "moe_norm",
                    f"{name} sum+add+norm T={T} {'fused' if fused else 'two kernels'}",
                    bench(fn, sz),
                    (T * K + 4 * T) * D * 2,
                    err=err if fused else None,
                    T=T,
                    fused=fused,
                )
    cfg = ModelConfig.from_hf(load_preset(sz.shared_preset))
    with torch.device(sz.dev):
        layers = [DeepseekV3MoE(cfg, RankInfo(), BF, "triton") for _ in range(sz.layers)]
        norms = [RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=BF) for _ in range(sz.layers)]
    for i, (layer, norm) in enumerate(zip(layers, norms)):
        init_dummy_weights(layer, seed=i)
        norm.weight.data.normal_(1.0, 0.1)
    for T in sz.norm_T:
        x, res = (torch.randn(T, cfg.hidden_size, device=sz.dev).to(BF) for _ in range(2))
        unfused = None
        for fused in (False, True):
            for layer, norm in zip(layers, norms):
                layer.fuse_norm = fused
                out = layer(x, norm, res)[0]  # compiles, and the router's one-time bf16 check before capture
            unfused = out if unfused is None else unfused
            ms = bench(lambda: [layer(x, norm, res) for layer, norm in zip(layers, norms)], sz) / len(layers)  # noqa: B023
            rep.add(
                "moe_norm",
                f"{sz.shared_preset} block+norm T={T} {'fused' if fused else 'unfused'}",
                ms,
                err=rel(out, unfused) if fused else None,
                T=T,
                fused=fused,
                layers=len(layers),
            )
    layers = None
    if sz.dev == "cuda":
        torch.cuda.empty_cache()


# decode MoE as the engine runs it (shared experts fused in: K + S pairs per token), gemm1 and gemm2 tiles swept
# apart (the other GEMM on its default), over sz.layers layers' weights in turn (cold L2, as in the engine)
