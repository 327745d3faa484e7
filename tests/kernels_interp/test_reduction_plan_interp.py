"""Deterministic mode's reduction plan depends on nothing but the row: every decision point of the GPU path
(kernels/plan.reduction_plan asks the call sites' own predicates) takes the same form and tiles at every step size,
decode batch and CUDA-graph bucket; the MLA decode cut depends on the sequence's length alone. The points that
configuration cannot fix are listed, and shown to still vary, rather than passed over."""

import pytest

DSV3 = dict(hidden=7168, heads=128, experts=256, top_k=8, n_shared=1, moe_inter=2048)
STEP_SIZES = (*range(1, 70), 96, 128, 255, 257, 1000)  # and every CUDA-graph prefill bucket (_step_sizes)


def _step_sizes() -> list[int]:
    from mlaserve.engine.cuda_graph import PREFILL_TOKEN_BUCKETS

    return sorted({*STEP_SIZES, *PREFILL_TOKEN_BUCKETS})


def _plans(kernels, **kw):
    from mlaserve.kernels.plan import reduction_plan

    return {T: reduction_plan(kernels, T, **kw) for T in _step_sizes()}


@pytest.mark.parametrize("model", [{}, DSV3])
def test_deterministic_plan_is_the_same_at_every_step_size(model):
    from mlaserve.engine.cuda_graph import PREFILL_TOKEN_BUCKETS
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.plan import NOT_YET_INVARIANT_POINTS

    assert set(PREFILL_TOKEN_BUCKETS) <= set(_step_sizes())  # every graph bucket is walked
    plans = _plans(KernelConfig.from_env().batch_invariant(), **model)
    first = plans[1]
    for T, plan in plans.items():
        for point, choice in plan.items():
            if point not in NOT_YET_INVARIANT_POINTS:
                assert choice == first[point], (point, T, choice, first[point])
    assert first["linear"] == first["lm_head"] == "gemm" and first["router"] == first["absorb"] == "bi_gemm"
    assert first["dense_gemm"][0] == "bi_gemm"
    assert first["moe_form"] == "aligned" and first["fuse_shared"] and not first["absorb_store"]
    # what configuration cannot fix still varies: it stays listed (kernel_config.NOT_YET_INVARIANT) until fixed
    assert len({str(p["fp8_gemm_tiles"]) for p in plans.values()}) > 1


def test_default_plan_varies_so_the_walk_is_not_vacuous():
    from mlaserve.kernel_config import KernelConfig

    plans = _plans(KernelConfig())
    points = ("linear", "dense_gemm", "absorb", "router", "fuse_shared", "moe_form", "moe_tiles", "mla_decode")
    for point in (*points, "fp8_linear"):
        assert len({str(p[point]) for p in plans.values()}) > 1, point


def test_deterministic_mla_cut_depends_on_the_sequence_length_alone():
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.plan import reduction_plan

    k = KernelConfig().batch_invariant()
    for seq_len in (1, 31, 64, 65, 256, 257, 1000, 2048, 2049, 4096, 8192, 8193, 100_000):
        cuts = {reduction_plan(k, B, seq_len=seq_len)["mla_decode"] for B in (1, 2, 3, 4, 17, 64, 256)}
        assert len(cuts) == 1, (seq_len, cuts)
        S, _, _, _, cut = cuts.pop()
        m = k.mla_split_tokens
        assert cut == (m if seq_len <= S * m else -(-seq_len // (S * 32)) * 32), (seq_len, cut)
    # the default cut changes with the batch at one length
    assert len({reduction_plan(KernelConfig(), B, seq_len=4096)["mla_decode"][-1] for B in (1, 4, 64)}) > 1


def test_deterministic_verify_rows_are_decode_rows():
    """An EAGLE3 verify of width 2: by default its rows sit in other MLA tiles than plain decode's; in deterministic
    mode each runs as a decode row of its own, with decode's tiles and cut."""
    from mlaserve.kernel_config import NOT_YET_INVARIANT, KernelConfig
    from mlaserve.kernels.plan import reduction_plan

    default = reduction_plan(KernelConfig(), 8, q_len=1), reduction_plan(KernelConfig(), 16, q_len=2)
    assert default[0]["mla_rows"] != default[1]["mla_rows"]
    k = KernelConfig().batch_invariant()
    for seq_len in (40, 4096, 9000):
        decode, verify = reduction_plan(k, 8, q_len=1, seq_len=seq_len), reduction_plan(k, 16, q_len=2, seq_len=seq_len)
        assert decode["mla_rows"] == verify["mla_rows"] and decode["mla_decode"] == verify["mla_decode"]
    assert not any("verify" in line for line in NOT_YET_INVARIANT)


# Known batch-variant points a decode step and its padded graph twin may still differ in: cuBLAS picks its GEMM by
# M (dense_gemm); the bf16 fused MoE's M/N tiles and stages follow the tokens (moe_tiles: compared by their K tile,
# which with no K split fixes each output's order of sums).
TWIN_EXCEPTIONS = ("dense_gemm", "moe_tiles")
# Kimi-K2.5's routed experts on one rank (384 experts, top-8): whole, under EP2 / EP4 / EP8, MoE-TP4 / TP8 shards.
# The INT4 GEMV/GEMM edge is a count of expected distinct experts over all 384: it falls between 76 and 77 requests
# (inside the graph of 96), on every rank alike
KIMI = {
    f"kimi_{name}": dict(
        hidden=7168, heads=64, experts=e, num_experts=384, top_k=8, n_shared=1, moe_inter=i, vocab=163840
    )
    for name, e, i in (("all", 384, 2048), ("ep2", 192, 2048), ("ep4", 96, 2048), ("ep8", 48, 2048))
    + (("tp4", 384, 512), ("tp8", 384, 256))
}


def _k_tiles(tiles):
    return None if tiles is None else tuple(dict(c)["BLOCK_K"] for c in tiles)


MODELS = {"m1": {}, "dsv3": DSV3, **KIMI}


@pytest.mark.parametrize("model", MODELS, ids=str)
@pytest.mark.parametrize("q_len", [1, 2])
def test_eager_decode_planned_as_its_graph_twin(model, q_len):
    """Default mode: a decode step of b requests planned for the graph size g it pads to (ForwardBatch.
    plan_decode_reqs, plan_tokens) takes every decision point's choice the graph of g takes (but TWIN_EXCEPTIONS);
    planned for b alone, the MLA decode differs, and on Kimi-K2.5's ranks the INT4 experts' form (so the walk is
    not vacuous)."""
    from mlaserve.engine.cuda_graph import decode_graph_size, graph_safe_kernels
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.plan import reduction_plan

    model, kw = MODELS[model], dict(MODELS[model], q_len=q_len)
    max_num_seqs = 128
    k = graph_safe_kernels(KernelConfig(), max_num_seqs, q_len)
    differed, int4_differed = 0, set()
    for b in range(1, max_num_seqs + 1):
        g = decode_graph_size(b, q_len, max_num_seqs, float("inf"))
        twin = reduction_plan(k, g * q_len, **kw)
        step = reduction_plan(k, b * q_len, plan_reqs=g, **kw)
        for point, choice in step.items():
            if point not in TWIN_EXCEPTIONS:
                assert choice == twin[point], (point, b, g, choice, twin[point])
        assert _k_tiles(step["moe_tiles"]) == _k_tiles(twin["moe_tiles"]), (b, g)
        alone = reduction_plan(k, b * q_len, **kw)
        differed += alone["mla_decode"] != twin["mla_decode"]
        if alone["int4_form"] != twin["int4_form"]:
            int4_differed.add(b)
    assert differed
    if model in KIMI.values() and q_len == 1:
        assert int4_differed == set(range(65, 77)), int4_differed  # GEMV alone, the GEMM in the graph of 96
