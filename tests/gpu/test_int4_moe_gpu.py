"""The INT4 MoE kernels (kernels/int4_moe.py) on CUDA at Kimi-K2.5's expert shapes (full, MoE-TP4/TP8 shards, EP8
with 48 local experts), all forms (GEMV on the tensor cores, GEMV on FMAs, GEMM), every tile config kernels_bench
sweeps, and CUDA-graph capture + replay with new routings. Run:
PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_int4_moe_gpu.py"""

import pytest
import torch

from tests.helpers import kernel_checks as kc

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_seed")]
BF = torch.bfloat16
K = 8
SHAPES = {"kimi": (7168, 2048), "tp4": (7168, 512), "tp8": (7168, 256)}


def experts(D, I, E):
    from tests.helpers.int4_ref import random_int4_experts

    return random_int4_experts(E, D, I, "cuda")


def routing(T, E_local, offset, E_all):
    """K distinct ids per token over E_all experts; this rank owns [offset, offset + E_local)."""
    ids = torch.rand(T, E_all, device="cuda").topk(K, -1).indices
    return ids, torch.rand(T, K, device="cuda") + 0.1


def check(w, T, offset=0, E_all=None, form=None, config=None, ids_dtype=torch.int64, add=False, graph=False):
    from mlaserve.kernels.int4_moe import int4_fused_experts
    from tests.helpers.int4_ref import int4_fused_experts_ref

    E, D = w[0].shape[0], w[0].shape[2] * 8
    E_all = E_all or E
    ids, tw = routing(T, E, offset, E_all)
    ids = ids.to(ids_dtype)
    x = torch.randn(T, D, device="cuda").to(BF)
    extra = torch.randn(T, D, device="cuda").to(BF) if add else None
    cfg = dict(config or {}, **({"form": form} if form else {}))
    local = E_all == E

    def run():  # under EP with the expert count, as layers.quant_experts passes it
        n = 0 if local else E_all
        return int4_fused_experts(x, *w, tw, ids, offset, add=extra, all_local=local, config=cfg, num_experts=n)

    what = f"int4 moe T={T} E={E}/{E_all} off={offset} {cfg}"
    if graph:
        g, out = kc.cuda_graph(run)
        for _ in range(2):  # new routing and activations, same buffers
            new_ids, new_tw = routing(T, E, offset, E_all)
            ids.copy_(new_ids)
            tw.copy_(new_tw)
            x.copy_(torch.randn(T, D, device="cuda").to(BF))
            out.fill_(float("nan"))
            g.replay()
            ref = int4_fused_experts_ref(x.float(), *w, tw, ids, offset, add=None if extra is None else extra.float())
            kc.assert_close(out, ref, BF, what + " graph replay")
        return
    with kc.poisoned_empty():
        out = run()
    ref = int4_fused_experts_ref(x.float(), *w, tw, ids, offset, add=None if extra is None else extra.float())
    kc.assert_close(out, ref, BF, what)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(
    "T,form", [(1, None), (2, None), (3, "gemv"), (8, None), (1, "gemv_fma"), (2, "gemv_fma"), (1, "gemm"), (40, None)]
)
def test_int4_moe_kimi_shapes(shape, T, form):
    # 32 experts of the real shape (the kernels never see the expert count but through the ids); T=40: the GEMM
    # form (320 pairs), most experts with several rows
    D, I = SHAPES[shape]
    check(experts(D, I, 32), T, form=form, add=T == 2, ids_dtype=torch.int32 if T == 3 else torch.int64)


@pytest.mark.parametrize("T,form", [(1, None), (2, None), (8, "gemv"), (8, "gemv_fma"), (8, "gemm"), (300, None)])
def test_int4_moe_expert_parallel(T, form):
    # EP8: this rank owns experts [96, 144) of 384; T=300: 2400 pairs, the multi-program align
    check(experts(7168, 2048, 48), T, offset=96, E_all=384, form=form)


def test_int4_moe_prefill_chunk():
    # a 2048-token chunk over 64 experts of the TP4 shard: ~256 rows an expert (BLOCK_M 128 tiles)
    check(experts(7168, 512, 64), 2048)


@pytest.mark.parametrize("shape", ["kimi", "tp4"])
def test_int4_moe_prefill_middle_band(shape):
    # 320 tokens over 64 experts: ~40 rows an expert, between INT4_ROW_BANDS' edges (the transposed 64-row tiles);
    # in a CUDA graph, its output poisoned before each replay
    D, I = SHAPES[shape]
    check(experts(D, I, 64), 320, graph=True)


@pytest.mark.parametrize("shape", ["kimi", "tp4"])
def test_int4_moe_prefill_tail_list(shape):
    # 1,400 tokens over 64 experts: ~175 rows an expert in 128-row blocks, the last rows of most in moe_align's
    # tail list (64-row tiles); in a CUDA graph, its output poisoned before each replay
    D, I = SHAPES[shape]
    t = dict(BLOCK_M=128, BLOCK_N=64, TRANS=True, TAIL=dict(BLOCK_M=64, BLOCK_N=128))
    check(experts(D, I, 64), 1400, config=dict(form="gemm", gemm1=t, gemm2=t), graph=True)


@pytest.mark.parametrize("T,offset,E_all", [(1, 0, None), (2, 96, 384), (64, 96, 384)])
def test_int4_moe_cuda_graph_replay(T, offset, E_all):
    # T=1, 2: the GEMV form; 64: the GEMM form (512 pairs, single-program align), under EP
    check(experts(7168, 512, 48), T, offset=offset, E_all=E_all, graph=True)


def test_int4_moe_swept_configs_are_correct():
    # every tile kernels_bench --only int4_moe times, so a fast config is never a wrong one
    from benchmarks.int4_moe_bench import GEMM_SWEEP, GEMV1_SWEEP, GEMV2_SWEEP, gemv2_variant

    for D, I in SHAPES.values():
        w = experts(D, I, 16)
        for v in GEMV1_SWEEP:
            check(w, 1, form="gemv_fma", config=dict(gemv1=v))
        for v in GEMV2_SWEEP:
            check(w, 1, form="gemv_fma", config=dict(gemv2=gemv2_variant(v, D, I, K)))
    w = experts(7168, 2048, 16)
    for c in GEMM_SWEEP:
        check(w, 96, form="gemm", config=dict(gemm1=c, gemm2=c))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_int4_moe_mma_sweep_is_correct(shape):
    # every tensor-core GEMV tile kernels_bench times (register caps, cp.async stages, row blocks), at 1 and 3 tokens
    from benchmarks.int4_moe_bench import MMA_QUICK, mma_variants

    D, I = SHAPES[shape]
    w = experts(D, I, 16)
    variants = mma_variants(D, I, K, sweep=True) + mma_variants(D, I, K, sweep=True, table=MMA_QUICK)[1:]
    for c1, c2 in variants:
        check(w, 1, form="gemv_mma", config=dict(mma1=c1, mma2=c2))
    for c1, c2 in variants[1::3]:  # 3 tokens: pairs of one expert (16 experts), two at a time
        check(w, 3, form="gemv_mma", config=dict(mma1=c1, mma2=c2))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_int4_moe_pairs_of_one_expert(shape):
    # 8 tokens over 12 experts: most experts serve several pairs (two at a time, a third alone), under EP with
    # other ranks' pairs; the pairing on and off
    D, I = SHAPES[shape]
    w = experts(D, I, 12)
    for pair in (True, False):
        check(w, 8, offset=4, E_all=20, form="gemv_mma", config=dict(pair=pair), add=True)


# (local experts, their first id, intermediate shard, step requests b, the decode graph g it pads to): EP4 and EP2,
# where the GEMV/GEMM edge falls inside a graph (33 -> 48, 67 -> 96); the whole expert at 5 -> 8, where the pairing
# of one expert's pairs turns on, and the MoE-TP8 shard at 3 -> 4, where the GEMV's row tiles change
# (kernels/plan.py's twin walk lists these)
TWINS = {
    "ep4": (96, 96, 2048, 65, 96),
    "ep2": (192, 192, 2048, 67, 96),
    "all": (384, 0, 2048, 5, 8),
    "tp8": (384, 0, 256, 3, 4),
}


@pytest.mark.parametrize("case", list(TWINS))
def test_int4_moe_eager_step_equals_its_graph_twin(case):
    """An eager decode step of b requests planned as the graph of g it pads to (plan_tokens, ForwardBatch.
    plan_tokens) gives its rows bit for bit as the g-row step does, the pad rows routed as real ones (the pairing
    scan sees them). Planned alone, its form, tiles or pairing differ (printed: how many values that changes)."""
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.int4_mma_run import pair_width
    from mlaserve.kernels.int4_moe import int4_fused_experts, int4_plan

    E, offset, I, b, g = TWINS[case]
    w = experts(7168, I, E)
    ids, tw = routing(g, E, offset, 384)
    ids[b:], tw[b:] = ids[: g - b], tw[: g - b]  # pad rows: copies of real rows' routing
    x = torch.randn(g, 7168, device="cuda").to(BF)
    run = dict(expert_offset=offset, all_local=E == 384, num_experts=384)
    twin = int4_fused_experts(x, *w, tw, ids, **run)
    with kc.poisoned_empty():
        step = int4_fused_experts(x[:b], *w, tw[:b], ids[:b], plan_tokens=g, **run)
    assert torch.equal(step, twin[:b]), case
    alone = int4_fused_experts(x[:b], *w, tw[:b], ids[:b], **run)
    plans = [(*int4_plan(t, K, E, 7168, I, BF, KernelConfig(), True, 384), pair_width(t, K, E, 384)) for t in (b, g)]
    print(f"{case}: alone {plans[0][0]}, planned {plans[1][0]}; alone, {(alone != step).sum()} values differ")
    assert plans[0] != plans[1]
    if case in ("ep4", "ep2"):
        assert plans[0][0] != plans[1][0]


def test_int4_moe_deterministic_mode_is_batch_invariant():
    """Deterministic mode (KernelConfig.batch_invariant) at Kimi-K2.5's expert shape: each token's row is the same
    bits in steps of 1, 3, 33 and 300 tokens (one tile config for every step, kernels.int4_fixed_config)."""
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.int4_moe import int4_fused_experts
    from tests.helpers.int4_ref import int4_fused_experts_ref

    k = KernelConfig().batch_invariant()
    w = experts(7168, 2048, 48)
    ids, tw = routing(300, 48, 96, 384)
    x = torch.randn(300, 7168, device="cuda").to(BF)
    outs = [int4_fused_experts(x[:t], *w, tw[:t], ids[:t], 96, all_local=False, kernels=k) for t in (1, 3, 33, 300)]
    for a, b in zip(outs, outs[1:]):
        assert torch.equal(a, b[: a.shape[0]])
    ref = int4_fused_experts_ref(x[:33].float(), *w, tw[:33], ids[:33], 96)
    kc.assert_close(outs[2], ref, BF, "int4 moe deterministic")


@pytest.mark.parametrize("shape", ["tp4", "tp8"])
def test_int4_moe_unrolled_gemv1_gives_the_same_bits(shape):
    # one-token steps on the MoE-TP shards run the tensor-core gemv1 with K's trips unrolled (mma_config's UNROLL):
    # the same sums in the same order as the runtime loop, so the same bits; and as programs of 2 x 8 gate rows
    from mlaserve.kernels.int4_moe import int4_fused_experts

    D, I = SHAPES[shape]
    w = experts(D, I, 32)
    for _ in range(3):
        ids, tw = routing(1, 32, 0, 32)
        x = torch.randn(1, D, device="cuda").to(BF)
        rolled = dict(form="gemv_mma", mma1=dict(UNROLL=False, PREFETCH=True, maxnreg=None))
        a = int4_fused_experts(x, *w, tw, ids, config=dict(form="gemv_mma"))
        b = int4_fused_experts(x, *w, tw, ids, config=rolled)
        assert torch.equal(a, b), (a - b).abs().max()
        mr2 = dict(form="gemv_mma", mma1=dict(MR=2, WG=8, UNROLL=True, maxnreg=128))
        c = int4_fused_experts(x, *w, tw, ids, config=mr2)
        assert torch.equal(a, c), (a - c).abs().max()
