"""The INT4 MoE kernels (int4_moe.py: the GEMV form and the grouped GEMM form) under the interpreter, against
int4_fused_experts_ref: bf16 and fp32, one token / two / odd counts, EP offsets with non-local ids, `add`, int32 ids,
trips and masked tails, poisoned buffers (every output element must be written)."""

import pytest
import torch

from tests.helpers.kernel_checks import assert_close, poisoned_empty


@pytest.fixture(autouse=True)
def bf16_round_to_nearest(kdev):
    """The interpreter truncates fp32 -> bf16 casts; compiled kernels round to nearest even
    (tests/helpers/interp_bf16.py)."""
    if kdev != "cpu":
        yield
        return
    from tests.helpers.interp_bf16 import bf16_round_to_nearest

    with bf16_round_to_nearest():
        yield


def inputs(kdev, dtype, T, D, I, E, K, offset, seed=0, foreign=2, ids_dtype=torch.int64):
    """Random INT4 experts and a routing of K distinct ids per token among E local + `foreign` other-rank experts
    (ids offset..offset+E-1 local; the rest on both sides of the local range)."""
    from tests.helpers.int4_ref import random_int4_experts

    g = torch.Generator().manual_seed(seed)
    w = [t.to(kdev) for t in random_int4_experts(E, D, I, "cpu", generator=g)]
    x = torch.randn(T, D, generator=g).to(dtype).to(kdev)
    raw = torch.stack([torch.randperm(E + foreign, generator=g)[:K] for _ in range(T)])
    ids = (raw - foreign // 2 + offset).to(ids_dtype).to(kdev)  # foreign // 2 ids below the range, the rest above
    tw = (torch.rand(T, K, generator=g) + 0.1).to(kdev)
    return x, w, ids, tw


def check(kdev, dtype, T, D, I, E, K, offset=0, config=None, add=False, seed=0, foreign=2, ids_dtype=torch.int64, **kw):
    from mlaserve.kernels.int4_moe import int4_fused_experts
    from tests.helpers.int4_ref import int4_fused_experts_ref

    x, w, ids, tw = inputs(kdev, dtype, T, D, I, E, K, offset, seed, foreign, ids_dtype)
    extra = torch.randn(T, D).to(dtype).to(kdev) if add else None
    with poisoned_empty():
        out = int4_fused_experts(x, *w, tw, ids, offset, add=extra, all_local=foreign == 0, config=config, **kw)
    assert out.shape == (T, D) and out.dtype == dtype
    ref = int4_fused_experts_ref(x.float(), *w, tw, ids, offset, add=None if extra is None else extra.float())
    assert_close(out, ref, dtype, f"int4 moe T={T} D={D} I={I} E={E} K={K} off={offset} {config} {dtype}")


# few programs per call keep the interpreter fast: whole rows in one trip, many rows a program
GEMV = dict(form="gemv_fma", gemv1=dict(ROWS=16), gemv2=dict(ROWS=64))
GEMM = dict(form="gemm")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,offset,add", [(1, 0, False), (2, 4, True), (3, 0, True)])
def test_gemv_form(kdev, dtype, T, offset, add):
    check(kdev, dtype, T, D=64, I=32, E=4, K=2, offset=offset, config=GEMV, add=add, seed=T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,offset,add", [(1, 0, True), (5, 3, False)])
def test_gemm_form(kdev, dtype, T, offset, add):
    check(kdev, dtype, T, D=64, I=32, E=4, K=2, offset=offset, config=GEMM, add=add, seed=10 + T)


def _gemm_tiles(bk, trans):
    c = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=2, TRANS=trans)
    return dict(form="gemm", gemm1=c, gemm2=dict(c))


@pytest.mark.parametrize(
    "D,I,cfg",
    [
        (64, 32, GEMM),  # the default tiles (BLOCK_K 128 over K = 64 / 32: masked K)
        (128, 64, _gemm_tiles(64, True)),  # whole K steps, scales read as words of two groups (_even: 2)
        (128, 64, _gemm_tiles(64, False)),  # the same untransposed
        (96, 64, _gemm_tiles(32, True)),  # whole K steps of one group (_even: 1)
    ],
)
def test_gemm_bf16_pairs(kdev, mma, monkeypatch, D, I, cfg):
    """The GEMMs' dequantization in bf16 pairs (int4_gemm.DEQ_BF2_ASM, run by tests/interp_mma.py on CPU)."""
    from mlaserve.kernels import int4_gemm

    monkeypatch.setattr(int4_gemm, "BF2_ON_CPU", True)
    check(kdev, torch.bfloat16, 5, D, I, E=4, K=2, offset=1, config=cfg, add=True, seed=D + I)


@pytest.mark.parametrize(
    "cfg",
    [
        # gemv1 over 3 trips of 1 group with the next trip's loads first; gemv2 over 2 trips, plain
        dict(form="gemv_fma", gemv1=dict(ROWS=16, G=1, PREFETCH=True), gemv2=dict(ROWS=64, G=1)),
        # 2-group trips over 3 groups (a masked half trip), row blocks past I and D (masked rows)
        dict(form="gemv_fma", gemv1=dict(ROWS=8, G=2), gemv2=dict(ROWS=64, G=2, PREFETCH=True)),
    ],
)
def test_gemv_trips_and_tails(kdev, cfg):
    # D = 96: 3 groups; I = 64 with gemv2 rows of 64 over D = 96 (the second block half real)
    check(kdev, torch.float32, T=1, D=96, I=64, E=3, K=2, config=cfg, seed=20)


@pytest.fixture
def mma(kdev):
    """The tensor-core GEMV's inline PTX, run by tests/interp_mma.py under the interpreter (compiled on a GPU)."""
    if kdev != "cpu":
        yield
        return
    from tests.interp_mma import emulate_mma

    with emulate_mma():
        yield


@pytest.mark.parametrize(
    "T,D,I,offset,add,cfg",
    [
        # the default tiles: one trip of 16 groups over D = 512 (gemv1), 4 over I = 128 (gemv2, one warp column)
        (1, 512, 128, 0, False, {}),
        # gemv1 over a masked half trip (12 groups, trips of 16), gemv2 over 2-warp trips of 8 groups; EP offsets
        (3, 384, 256, 2, True, dict(mma1=dict(MR=4, WG=4), mma2=dict(MR=2, WG=2))),
        # next trip's loads first, shifts by shr, 8 warps over 32-group trips (gemv1: 3 trips, the last masked)
        (
            2,
            640,
            128,
            1,
            False,
            dict(
                mma1=dict(MR=1, WG=8, PREFETCH=True, MUL=False),
                mma2=dict(MR=4, WG=1, PREFETCH=True),
            ),
        ),
        # K's trips unrolled (NGC): 4 whole trips of 16 groups, then 8 warps over 20 groups (one masked trip)
        (1, 2048, 128, 0, False, dict(mma1=dict(MR=1, WG=4, UNROLL=True))),
        (1, 640, 256, 1, True, dict(mma1=dict(MR=2, WG=8, UNROLL=True))),
    ],
)
def test_gemv_mma_form(kdev, mma, T, D, I, offset, add, cfg):
    check(
        kdev,
        torch.bfloat16,
        T,
        D,
        I,
        E=5,
        K=2,
        offset=offset,
        config=dict(form="gemv_mma", **cfg),
        add=add,
        seed=30 + T,
    )


@pytest.mark.parametrize("pair,c2", [(True, {}), (True, dict(MR=1, WG=1, NB=4)), (False, {})])
def test_gemv_mma_pairs_of_one_expert(kdev, mma, pair, c2):
    # 5 tokens x 2 over 3 local experts and 2 foreign: most experts serve 2-4 pairs (the first two in one pass, a
    # third and fourth alone) and the foreign ones none; with pair=False every pair alone
    cfg = dict(form="gemv_mma", pair=pair, mma2=c2)
    check(kdev, torch.bfloat16, 5, 256, 128, E=3, K=2, offset=2, config=cfg, seed=36, add=True)


@pytest.mark.parametrize("n", [12, 64])
def test_gemv_mma_ep_rank_tiles(kdev, mma, n, monkeypatch):
    # an EP rank's default tiles, chosen for the pairs it is expected to own of n experts in all (8-warp gemv1
    # programs of 8 gate rows; pairing on at n = 12, off at 64): the call hands the count to both choices
    from mlaserve.kernels import int4_mma_run, int4_moe

    seen = []
    for mod, name in ((int4_moe, "mma_config"), (int4_mma_run, "pair_width")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=fn, _n=name: (seen.append((_n, a)), _f(*a))[1])
    cfg = dict(form="gemv_mma")
    check(
        kdev, torch.bfloat16, 2, 256, 128, E=3, K=2, offset=2, config=cfg, seed=39, foreign=4, add=True, num_experts=n
    )
    assert seen == [("mma_config", (256, 128, 4, 4 * 3 / n)), ("pair_width", (2, 2, 3, n))]


@pytest.mark.parametrize(
    "D,I,c2",
    [
        # gemv2 over blocks of 32 rows, 8 a program (20 blocks: the last program has 4), K in one trip
        (640, 128, dict(MR=2, WG=1, NB=8, NS=2)),
        # blocks of 32 rows, 8 a program over 12 blocks; one trip of 8 groups over 4 (a masked half trip)
        (384, 128, dict(MR=2, WG=2, NB=8, NS=3, MUL=False)),
    ],
)
def test_gemv_mma_row_blocks(kdev, mma, D, I, c2):
    check(kdev, torch.bfloat16, 2, D, I, E=5, K=2, offset=1, config=dict(form="gemv_mma", mma2=c2), seed=35)


def test_gemv_picks_mma_where_it_applies(kdev, mma, monkeypatch):
    # bf16 with D, I multiples of 128 (I = 512 or 256: one token): the tensor-core GEMV; fp32, or other sizes, or
    # I = 512 at several tokens: the FMA GEMV
    from mlaserve.kernels import int4_moe

    calls = []
    for name in ("int4_gemv", "int4_gemv_mma"):
        fn = getattr(int4_moe, name)
        monkeypatch.setattr(int4_moe, name, lambda *a, _f=fn, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    check(kdev, torch.bfloat16, T=1, D=128, I=512, E=4, K=2, seed=33, ids_dtype=torch.int32)
    check(kdev, torch.float32, T=1, D=128, I=512, E=4, K=2, seed=34)
    check(kdev, torch.bfloat16, T=5, D=128, I=512, E=4, K=2, seed=37, config=dict(form="gemv"))  # 10 pairs on 4
    check(kdev, torch.bfloat16, T=1, D=256, I=128, E=4, K=2, seed=38)
    check(kdev, torch.bfloat16, T=1, D=128, I=256, E=4, K=2, seed=39)
    assert calls == ["int4_gemv_mma", "int4_gemv", "int4_gemv", "int4_gemv", "int4_gemv_mma"]
    with pytest.raises(ValueError, match="gemv_mma"):
        check(kdev, torch.bfloat16, T=1, D=96, I=64, E=3, K=2, config=dict(form="gemv_mma"))


def test_gemm_masked_k_and_n(kdev):
    # BLOCK_K 64 over D = 96 and I = 96 (a half-real last K step), BLOCK_N 64 over I = 96 and D = 96
    cfg = dict(form="gemm", gemm1=dict(BLOCK_N=64, BLOCK_K=64), gemm2=dict(BLOCK_N=64, BLOCK_K=64))
    check(kdev, torch.float32, T=3, D=96, I=96, E=3, K=2, config=cfg, seed=21)


def test_gemm_many_rows_per_expert(kdev):
    # 24 tokens over 2 experts, no foreign ids: several BLOCK_M blocks per expert, all_local (the sum reads no ids)
    check(kdev, torch.bfloat16, T=24, D=64, I=32, E=2, K=2, config=GEMM, seed=22, foreign=0)


@pytest.mark.parametrize("block_k, trans", [(64, False), (128, False), (128, True)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_gemm_whole_k_steps(kdev, block_k, trans, scale_dtype, monkeypatch):
    # K a multiple of BLOCK_K: no K mask; bf16 scales read two groups a 4-byte word (int4_gemm._even = 2), fp16
    # ones one group at a time (1)
    import tests.helpers.int4_ref as ref
    from mlaserve.kernels.int4_gemm import _even

    assert _even(256, block_k, torch.empty(3, 256, 8, dtype=scale_dtype)) == (2 if scale_dtype == torch.bfloat16 else 1)
    assert _even(96, 64, torch.empty(3, 256, 3, dtype=scale_dtype)) == 0
    real = ref.random_int4_experts
    monkeypatch.setattr(
        ref,
        "random_int4_experts",
        lambda *a, **k: [t if i % 2 == 0 else t.to(scale_dtype) for i, t in enumerate(real(*a, **k))],
    )
    t = dict(BLOCK_N=64, BLOCK_K=block_k, TRANS=trans)
    check(
        kdev, torch.bfloat16, T=7, D=256, I=128, E=3, K=2, config=dict(form="gemm", gemm1=t, gemm2=t), seed=26, add=True
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("trans", [False, True])
def test_gemm_tail_list(kdev, dtype, trans):
    # TAIL: each expert's rows in 32-row blocks, an odd last 16-row half block in the tail list's 16-row tiles (its
    # own BLOCK_N). 3 local experts and 2 foreign ones; 40 tokens x 2: 14, 17 and 14 rows (a tail block alone, a
    # 32-row block alone); 100 tokens: 39, 35 and 46 (a 32-row block and a tail block each)
    t = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, TRANS=trans, TAIL=dict(BLOCK_M=16, BLOCK_N=32))
    for T in (40, 100):
        check(kdev, dtype, T=T, D=96, I=96, E=3, K=2, config=dict(form="gemm", gemm1=t, gemm2=t), seed=27, add=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_transposed(kdev, dtype):
    # TRANS: each GEMM computes its output transposed (weights the MMA's first operand); masked K and N steps
    # (BLOCK_K 64 over 96, BLOCK_N 64 over 96), several blocks per expert, foreign ids; one GEMM transposed alone
    t = dict(BLOCK_N=64, BLOCK_K=64, TRANS=True)
    check(kdev, dtype, T=24, D=96, I=96, E=3, K=2, config=dict(form="gemm", gemm1=t, gemm2=t), seed=23)
    check(kdev, dtype, T=5, D=96, I=96, E=3, K=2, config=dict(form="gemm", gemm1=t), seed=24, add=True)
    check(kdev, dtype, T=5, D=96, I=96, E=3, K=2, config=dict(form="gemm", gemm2=t), seed=25)


@pytest.mark.parametrize("form", ["gemv", "gemm"])
def test_int32_ids_and_default_form(kdev, form, monkeypatch):
    # int32 ids; the form picked by the pair count (kernels.int4_gemv_max_pairs lowered so 3 tokens x 2 pairs
    # exceed it or not)
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels import int4_moe

    calls = []
    for name in ("int4_gemv", "int4_gemm"):
        fn = getattr(int4_moe, name)
        monkeypatch.setattr(int4_moe, name, lambda *a, _f=fn, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    limit = KernelConfig(int4_gemv_max_pairs=6 if form == "gemv" else 5)
    check(kdev, torch.bfloat16, T=3, D=64, I=32, E=6, K=2, offset=1, seed=23, ids_dtype=torch.int32, kernels=limit)
    assert calls == [f"int4_{form}"]
    # pairs that share experts heavily take the GEMM form whatever the limit: 40 pairs over 2 experts
    calls.clear()
    check(kdev, torch.bfloat16, T=20, D=64, I=32, E=2, K=2, seed=24, foreign=0, kernels=KernelConfig())
    assert calls == ["int4_gemm"]


def test_plan_tokens_choose_form_and_tiles(kdev, monkeypatch):
    # an eager step planned as its padded graph twin: 2 tokens x 2 pairs take the GEMV form alone and the GEMM form
    # planned as 3 tokens (kernels.int4_gemv_max_pairs 5), with the twin's tiles; the rows equal the twin's
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels import int4_moe

    calls = []
    for name in ("int4_gemv", "int4_gemm"):
        fn = getattr(int4_moe, name)
        monkeypatch.setattr(
            int4_moe, name, lambda *a, _f=fn, _n=name, **k: (calls.append((_n, a[-2:])), _f(*a, **k))[1]
        )
    limit = KernelConfig(int4_gemv_max_pairs=5)
    x, w, ids, tw = inputs(kdev, torch.bfloat16, 3, 64, 32, 6, 2, 1, seed=41)
    twin = int4_moe.int4_fused_experts(x, *w, tw, ids, 1, all_local=False, kernels=limit)
    with poisoned_empty():
        step = int4_moe.int4_fused_experts(x[:2], *w, tw[:2], ids[:2], 1, all_local=False, kernels=limit, plan_tokens=3)
    int4_moe.int4_fused_experts(x[:2], *w, tw[:2], ids[:2], 1, all_local=False, kernels=limit)
    assert [c[0] for c in calls] == ["int4_gemm", "int4_gemm", "int4_gemv"] and calls[0][1] == calls[1][1]
    assert torch.equal(step, twin[:2])


def test_deterministic_mode_rows_do_not_depend_on_the_step(kdev, monkeypatch):
    # deterministic mode (KernelConfig.batch_invariant): the grouped GEMM with int4_fixed_config's tiles at every
    # step, so the first tokens' rows are the same bits in steps of 2, 5 and 40 tokens
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels import int4_moe

    tiles = []
    fn = int4_moe.int4_gemm
    monkeypatch.setattr(int4_moe, "int4_gemm", lambda *a: (tiles.append(a[-2:]), fn(*a))[1])
    k = KernelConfig().batch_invariant()
    x, w, ids, tw = inputs(kdev, torch.bfloat16, 40, 256, 128, 6, 2, 1, seed=43)
    outs = [int4_moe.int4_fused_experts(x[:t], *w, tw[:t], ids[:t], 1, all_local=False, kernels=k) for t in (2, 5, 40)]
    assert all(c == (k.int4_fixed_config(),) * 2 for c in tiles) and len(tiles) == 3
    assert torch.equal(outs[0], outs[1][:2]) and torch.equal(outs[1], outs[2][:5])


def test_no_tokens(kdev):
    from mlaserve.kernels.int4_moe import int4_fused_experts

    x, w, ids, tw = inputs(kdev, torch.bfloat16, 1, 64, 32, 4, 2, 0)
    out = int4_fused_experts(x[:0], *w, tw[:0], ids[:0])
    assert out.shape == (0, 64)


def test_bad_arguments_name_the_field(kdev):
    from mlaserve.kernels.int4_moe import int4_fused_experts

    x, (w13p, w13s, w2p, w2s), ids, tw = inputs(kdev, torch.bfloat16, 2, 64, 32, 4, 2, 0)
    bad = [
        (dict(x=x[:, :48]), "multiple of 32"),
        (dict(w13s=w13s.float().to(torch.int32)), "w13_scale must be bf16"),
        (dict(w2p=w2p[:, :, :2]), r"w2_packed must be \[4, 64, 4\]"),
        (dict(w13p=w13p.float()), "w13_packed must be int32"),
        (dict(ids=ids.float()), "topk_ids must be"),
        (dict(tw=tw.double()), "topk_weights must be"),
        (dict(w13p=w13p[:, :40], w13s=w13s[:, :40]), "I=20 must be a multiple of 32"),
    ]
    for change, msg in bad:
        args = dict(x=x, w13p=w13p, w13s=w13s, w2p=w2p, w2s=w2s, tw=tw, ids=ids, **{})
        args.update(change)
        with pytest.raises(ValueError, match=msg):
            int4_fused_experts(args["x"], args["w13p"], args["w13s"], args["w2p"], args["w2s"], args["tw"], args["ids"])
    with pytest.raises(ValueError, match="form"):
        int4_fused_experts(x, w13p, w13s, w2p, w2s, tw, ids, config=dict(form="fast"))
    with pytest.raises(ValueError, match="config keys"):
        int4_fused_experts(x, w13p, w13s, w2p, w2s, tw, ids, config=dict(BLOCK_M=16))
    tail = dict(form="gemm", gemm1=dict(BLOCK_M=32, TAIL=dict(BLOCK_M=32)), gemm2=dict(BLOCK_M=32, TAIL={}))
    with pytest.raises(ValueError, match="TAIL's BLOCK_M=32 must be half of BLOCK_M=32"):
        int4_fused_experts(x, w13p, w13s, w2p, w2s, tw, ids, config=tail)
    with pytest.raises(ValueError, match="gemm1 and gemm2 take a TAIL together"):
        int4_fused_experts(x, w13p, w13s, w2p, w2s, tw, ids, config=dict(tail, gemm2=dict(BLOCK_M=32)))
    for n, local in ((3, False), (8, True)):  # fewer experts in all than local ones; all local but more in all
        with pytest.raises(ValueError, match=f"num_experts={n} must be 0 or at least the 4 local experts"):
            int4_fused_experts(x, w13p, w13s, w2p, w2s, tw, ids, all_local=local, num_experts=n)


def test_default_form_under_ep_judges_sharing_over_all_experts():
    # The GEMV form while the pairs are at most int4_gemv_sharing x the distinct experts they select. An EP8 rank
    # of Kimi-K2.5 (48 of 384 experts) at 32 tokens owns ~32 of the step's 256 pairs on ~23 experts: judged over
    # its 48 that would be 256 pairs on ~48 (the GEMM); judged over all 384, as the owned pairs are, the GEMV.
    # The edge then sits where the all-local step's does (kernels_bench --only int4_moe, docs/kernels.md)
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.int4_moe import default_form, int4_plan

    def last_gemv(E, n=0, k=KernelConfig()):
        return max(t for t in range(1, 200) if default_form(t * 8, E, k, n) == "gemv")

    assert last_gemv(384) == last_gemv(48, 384) == last_gemv(96, 384) == 76
    assert last_gemv(48) == 9 and last_gemv(48, 48) == 9  # all local: sharing over its own 48
    assert last_gemv(384, k=KernelConfig(int4_gemv_sharing=3.0)) == 128  # int4_gemv_max_pairs caps it
    assert default_form(32 * 8, 48) == "gemm" and default_form(32 * 8, 48, num_experts=384) == "gemv"
    plan = int4_plan(32, 8, 48, 7168, 2048, torch.bfloat16, KernelConfig(), True, 384)
    assert plan[0] == "gemv_mma" and int4_plan(32, 8, 48, 7168, 2048, torch.bfloat16, KernelConfig(), True)[0] == "gemm"


def test_ep_rank_tiles_follow_the_pairs_it_owns():
    # Kimi-K2.5's experts (7168 -> 2048, top-8 of 384). An EP8 rank (48 local) expects 1 of a one-token step's 8
    # pairs and 2 of a two-token step's 16: gemv1 in programs of 8 gate rows and 8 warps, gemv2 of 4 warps (the
    # all-local tiles are sized for all the pairs), and no pairing: two tokens share ~2 % of their experts, not the
    # ~14 % that 16 draws over 48 experts would (benchmarks/int4_ep_owned.py)
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.int4_mma_run import pair_width
    from mlaserve.kernels.int4_moe import int4_plan

    def tiles(T, E, n=0):
        form, c1, c2 = int4_plan(T, 8, E, 7168, 2048, torch.bfloat16, KernelConfig(), True, n)
        assert form == "gemv_mma"
        return c1["MR"], c1["WG"], c1.get("UNROLL", False), c1["maxnreg"], c2["MR"], c2["WG"], c2.get("maxnreg")

    assert tiles(1, 384) == (2, 4, False, 64, 2, 2, 64)
    assert tiles(1, 48) == tiles(1, 48, 48) == tiles(1, 384)  # no expert count: the all-local step's tiles
    shard, gemv2_4 = (1, 8, True, 128), (2, 4, 72)
    assert tiles(1, 48, 384) == tiles(2, 48, 384) == tiles(1, 192, 384) == (*shard, *gemv2_4)  # EP8, EP2
    assert tiles(8, 48, 384) == tiles(2, 384) == (2, 4, False, 64, *gemv2_4)  # 8 pairs owned: the all-local tiles
    assert pair_width(2, 8, 48) == 16 and pair_width(2, 8, 48, 384) == 0
    assert pair_width(8, 8, 48, 384) == 64  # 64 pairs over 384 share ~8 % of their experts
