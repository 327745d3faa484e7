"""fused_experts and the routing kernel under the interpreter, against layers.moe's references."""

import pytest
import torch

from tests.helpers.kernel_checks import check_fused_moe, check_moe_align, check_routing, decode_moe_inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_tiny(kdev, dtype):
    # the tiny preset: D=64 I=32 E=8 K=2
    check_fused_moe(kdev, dtype, T=5, D=64, I=32, E_total=8, E_local=8, offset=0, K=2)


def test_fused_moe_expert_parallel(kdev, monkeypatch):
    # this rank owns experts [4, 8) of 12: other experts contribute nothing; some tokens own none at all
    check_fused_moe(kdev, torch.float32, T=9, D=32, I=48, E_total=12, E_local=4, offset=4, K=3)
    from mlaserve.kernels import moe_align

    monkeypatch.setattr(moe_align, "FUSED_COUNT_MAX", 0)  # and with the multi-program align (chunks of 8 pairs)
    monkeypatch.setattr(moe_align, "ALIGN_CHUNK", 8)
    check_fused_moe(kdev, torch.float32, T=9, D=32, I=48, E_total=12, E_local=4, offset=4, K=3)


def test_fused_moe_uneven_k_and_n(kdev):
    # D and I not multiples of the tiles (masked K and N loops); one token only
    check_fused_moe(kdev, torch.float32, T=1, D=40, I=20, E_total=6, E_local=6, offset=0, K=2)


def test_fused_moe_many_rows_per_expert(kdev):
    # 48 tokens over 4 experts: several BLOCK_M blocks per expert (BLOCK_M forced to 16)
    check_fused_moe(kdev, torch.float32, T=48, D=32, I=16, E_total=4, E_local=4, offset=0, K=2, config=dict(BLOCK_M=16))


@pytest.mark.parametrize("fused_count", [True, False])
def test_moe_align_layout(kdev, fused_count, monkeypatch):
    from mlaserve.kernels import moe_align as ma
    from mlaserve.kernels.fused_moe import moe_align

    if not fused_count:  # the multi-program path used above FUSED_COUNT_MAX pairs
        monkeypatch.setattr(ma, "FUSED_COUNT_MAX", 0)
        monkeypatch.setattr(ma, "ALIGN_CHUNK", 2)

    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [9, 2]], device=kdev)  # expert 9 is not local (E_local = 6)
    sorted_ids, expert_ids, num_padded = moe_align(ids, 6, 0, 4)
    TK = ids.numel()
    n = int(num_padded)
    assert n == 4 * 4  # experts 0, 2, 3, 5 each padded to one block of 4
    assert expert_ids[:4].tolist() == [0, 2, 3, 5] and (expert_ids[4:] == -1).all()
    flat = ids.reshape(-1)
    for blk, e in enumerate(expert_ids[:4].tolist()):
        rows = sorted_ids[blk * 4 : (blk + 1) * 4].tolist()
        real = sorted(r for r in rows if r < TK)
        assert real == sorted((flat == e).nonzero().reshape(-1).tolist()), (blk, e, rows)
        assert all(r == TK for r in rows if r >= TK)


@pytest.mark.parametrize(
    "T,K,E_total,E_local,offset,block_m,kw",
    [
        (1, 6, 64, 64, 0, 16, {}),  # decode: one program
        (37, 3, 24, 24, 0, 4, {}),
        (37, 3, 24, 10, 7, 8, {}),  # EP: experts [7, 17) of 24
        (37, 3, 24, 24, 0, 4, dict(fused_max=0, chunk=16)),  # multi-program: 7 chunks, the last one partial
        (37, 3, 24, 10, 7, 8, dict(fused_max=0, chunk=16)),
        (64, 4, 40, 40, 0, 16, dict(fused_max=64, chunk=32)),  # 256 pairs > fused_max: 8 chunks
        (40, 2, 6, 6, 0, 2, dict(fused_max=0, chunk=64)),  # one chunk; many blocks per expert
        (20, 3, 200, 200, 0, 16, {}),  # many experts (one-hot lanes 256): one program up to 1024 / 4 pairs
        (100, 3, 260, 200, 60, 16, {}),  # 300 pairs: chunks of 512 / 4 = 128 pairs, 3 programs; EP
        # fused shared experts (the last slots) placed without counting: one program, then chunks that cut rows
        (5, 4, 14, 14, 0, 4, dict(shared=2)),
        (37, 3, 24, 24, 0, 4, dict(shared=1, fused_max=0, chunk=16)),
        (37, 5, 14, 14, 0, 8, dict(shared=2, fused_max=0, chunk=16)),
        (3, 2, 9, 9, 0, 16, dict(shared=2, fused_max=0)),  # shared slots only; padding of 13 rows each
        # the tail list (an expert's odd last half block): one program, chunks, EP, many experts
        (37, 3, 6, 6, 0, 8, dict(tail=True)),
        (37, 3, 6, 6, 0, 8, dict(tail=True, fused_max=0, chunk=16)),
        (64, 4, 12, 5, 3, 8, dict(tail=True, fused_max=0, chunk=32)),
        (64, 4, 12, 5, 3, 32, dict(tail=True, fused_max=0, chunk=32)),  # experts with one tail block only
        (100, 3, 260, 200, 60, 2, dict(tail=True)),
    ],
)
def test_moe_align_matches_stable_sort(kdev, T, K, E_total, E_local, offset, block_m, kw):
    check_moe_align(kdev, T=T, K=K, E_total=E_total, E_local=E_local, offset=offset, block_m=block_m, **kw)


def test_fused_moe_multi_program_align(kdev, monkeypatch):
    # T*K = 96 pairs above the (lowered) single-program limit: hist + align kernels over 6 chunks; EP and not
    from mlaserve.kernels import moe_align

    monkeypatch.setattr(moe_align, "FUSED_COUNT_MAX", 32)
    monkeypatch.setattr(moe_align, "ALIGN_CHUNK", 16)
    check_fused_moe(
        kdev, torch.float32, T=24, D=32, I=16, E_total=12, E_local=12, offset=0, K=4, config=dict(BLOCK_M=16)
    )
    check_fused_moe(kdev, torch.bfloat16, T=24, D=32, I=16, E_total=12, E_local=5, offset=6, K=4)


@pytest.mark.parametrize("no_align", [True, False])
def test_fused_moe_no_align(kdev, no_align):
    # no_align: each (token, k) pair its own M block, no moe_align; forced both ways on a tiny and an EP case
    cfg = dict(no_align=no_align)
    check_fused_moe(kdev, torch.float32, T=1, D=40, I=20, E_total=6, E_local=6, offset=0, K=2, config=cfg)
    check_fused_moe(kdev, torch.float32, T=9, D=32, I=48, E_total=12, E_local=4, offset=4, K=3, config=cfg)
    check_fused_moe(kdev, torch.bfloat16, T=3, D=64, I=32, E_total=8, E_local=8, offset=0, K=2, config=cfg)


def test_fused_moe_per_gemm_config(kdev):
    cfg = {"gemm1": dict(BLOCK_N=16, BLOCK_K=16, num_warps=2), "gemm2": dict(BLOCK_N=32, BLOCK_K=64, num_stages=3)}
    check_fused_moe(kdev, torch.float32, T=20, D=64, I=48, E_total=8, E_local=8, offset=0, K=2, config=cfg)
    check_fused_moe(
        kdev,
        torch.float32,
        T=20,
        D=64,
        I=48,
        E_total=8,
        E_local=8,
        offset=0,
        K=2,
        config=dict(BLOCK_K=16, gemm2=dict(BLOCK_M=32)),
    )  # BLOCK_M given for gemm2 applies to both


def test_moe_config_overrides():
    from mlaserve.kernels.moe_config import moe_config

    base1, base2 = moe_config(8192, 6, 64, 2048, 1408, torch.bfloat16)
    c1, c2 = moe_config(
        8192,
        6,
        64,
        2048,
        1408,
        torch.bfloat16,
        num_warps=4,
        gemm1=dict(BLOCK_N=64),
        gemm2=dict(BLOCK_K=128, num_warps=8),
    )
    assert c1 == dict(base1, BLOCK_N=64, num_warps=4) and c2 == dict(base2, BLOCK_K=128, num_warps=8)
    c1, c2 = moe_config(8192, 6, 64, 2048, 1408, torch.bfloat16, gemm1=dict(BLOCK_M=64))
    assert c1["BLOCK_M"] == c2["BLOCK_M"] == 64
    with pytest.raises(ValueError, match="share the alignment block"):
        moe_config(1, 6, 64, 2048, 1408, torch.bfloat16, gemm1=dict(BLOCK_M=16), gemm2=dict(BLOCK_M=32))
    with pytest.raises(ValueError, match="gemm2.BLOCK_Q"):
        moe_config(1, 6, 64, 2048, 1408, torch.bfloat16, gemm2=dict(BLOCK_Q=16))


def test_fused_moe_empty(kdev):
    check_fused_moe(kdev, torch.float32, T=0, D=32, I=16, E_total=4, E_local=4, offset=0, K=2)


@pytest.mark.parametrize("E,G,TG,K", [(8, 2, 1, 2), (64, 1, 1, 6), (32, 8, 3, 5), (24, 4, 4, 3)])
def test_routing(kdev, E, G, TG, K):
    # (8,2,1,2) the tiny preset; (64,1,1,6) Moonlight-like (no groups); (32,8,3,5) group selection; TG == G
    check_routing(kdev, T=7, E=E, n_group=G, topk_group=TG, K=K, norm=K != 5)


@pytest.mark.parametrize(
    "E,G,TG,K,S,norm,scaling",
    [
        (64, 1, 1, 6, 2, False, 1.0),  # DeepSeek-V2-Lite: greedy top-6 of 64, 2 shared slots
        (160, 8, 3, 6, 0, False, 16.0),  # DeepSeek-V2 / V2.5: group_limited_greedy, 8 groups keep 3
        (24, 4, 2, 3, 1, True, 2.0),  # groups of 6 (not a power of two: the grouped view loaded again); normalised
        (8, 2, 1, 2, 0, False, 1.0),
    ],
)
def test_routing_softmax(kdev, E, G, TG, K, S, norm, scaling):
    """DeepSeek-V2's softmax routing (greedy / group_limited_greedy, no bias) against layers.moe.route_softmax."""
    check_routing(
        kdev,
        T=9,
        E=E,
        n_group=G,
        topk_group=TG,
        K=K,
        norm=norm,
        scaling=scaling,
        num_shared=S,
        shared_id0=E,
        scoring_func="softmax",
    )


@pytest.mark.parametrize("preset", ["tiny", "v2"])
def test_routing_fused_matches_router_module(kdev, preset):
    from mlaserve.config import ModelConfig
    from mlaserve.kernels.routing import route_noaux_tc_fused
    from mlaserve.layers.moe import TopkRouter
    from mlaserve.models.make_random import load_preset

    raw = load_preset("tiny")
    if preset == "v2":  # DeepSeek-V2's group_limited_greedy: softmax, groups by their max, no correction bias
        raw |= dict(architectures=["DeepseekV2ForCausalLM"], topk_method="group_limited_greedy", scoring_func="softmax")
    cfg = ModelConfig.from_hf(raw)
    gate = TopkRouter(cfg).to(kdev)
    gate.weight.data.normal_()
    if cfg.has_correction_bias:
        gate.e_score_correction_bias.data.normal_(0, 0.1)
    x = torch.randn(6, cfg.hidden_size, device=kdev).to(torch.bfloat16)
    w, ids = route_noaux_tc_fused(gate, x)
    rw, rids = gate(x)
    assert torch.equal(ids.sort(-1).values, rids.sort(-1).values)
    torch.testing.assert_close(w.gather(1, ids.argsort(-1)), rw.gather(1, rids.argsort(-1)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_output_added_in_the_sum(kdev, dtype):
    """fused_experts(add=shared) == (routed sum rounded to the dtype) + shared, i.e. `y + shared` in torch;
    a strided `add`; tokens with no local expert get exactly `add`."""
    from mlaserve.kernels.fused_moe import fused_experts

    torch.manual_seed(3)
    T, D, I, E, K = 5, 64, 32, 8, 2
    x = torch.randn(T, D, device=kdev).to(dtype)
    w13 = (torch.randn(E // 2, 2 * I, D, device=kdev) / D**0.5).to(dtype)
    w2 = (torch.randn(E // 2, D, I, device=kdev) / I**0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, device=kdev)[:K] for _ in range(T)])
    ids[0] = torch.tensor([5, 6])  # owned by the other EP rank (offset 0, 4 local experts)
    w = torch.rand(T, K, device=kdev) + 0.1
    shared = torch.randn(T, D + 3, device=kdev).to(dtype)[:, :D]
    plain = fused_experts(x, w13, w2, w, ids, 0)
    out = fused_experts(x, w13, w2, w, ids, 0, add=shared)
    assert (
        torch.equal(out, plain + shared)
        or dtype == torch.bfloat16
        and kdev == "cpu"
        and torch.allclose(out.float(), (plain + shared).float(), rtol=1e-2, atol=1e-2)
    )  # the interpreter's bf16 rounding differs
    assert torch.equal(out[0], shared[0])
    with pytest.raises(ValueError, match="add"):
        fused_experts(x, w13, w2, w, ids, 0, add=shared[:2])


@pytest.mark.parametrize("T,D,I,E,K,S", [(1, 64, 32, 8, 2, 0), (1, 64, 32, 8, 6, 2), (3, 128, 64, 8, 2, 1)])
def test_fused_moe_tma_weights(kdev, T, D, I, E, K, S):
    """TMA (the sm_90 decode default): the GEMMs' weight tiles by TMA descriptors equal the pointer loads bit for bit
    in bf16, routed experts and shared slots; shapes the tiles do not divide are refused."""
    from mlaserve.kernels.fused_moe import fused_experts

    x, w13, w2, w, ids, kw = decode_moe_inputs(kdev, T=T, D=D, I=I, E=E, K=K, S=S)
    cfg = dict(BLOCK_N=16, BLOCK_K=32)
    ptr = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, tma=False), **kw)
    assert torch.equal(fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, tma=True), **kw), ptr)
    with pytest.raises(ValueError, match="tma"):
        fused_experts(x, w13, w2, w, ids, 0, config=dict(BLOCK_N=16, BLOCK_K=256, tma=True), **kw)
