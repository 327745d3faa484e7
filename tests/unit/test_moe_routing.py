"""noaux_tc routing (layers/moe.py) against transformers' DeepseekV3TopkRouter, and the reference experts
against a per-token loop."""

import pytest
import torch
import torch.nn.functional as F

from mlaserve.layers.moe import fused_experts_ref, route_noaux_tc

CASES = [  # (experts, top_k, n_group, topk_group, norm_topk_prob)
    (8, 2, 1, 1, True),
    (8, 2, 2, 1, True),
    (8, 3, 4, 2, True),
    (16, 4, 8, 3, False),
    (64, 6, 8, 4, True),
]


@pytest.mark.parametrize("E,K,G,TG,norm", CASES)
def test_route_noaux_tc_matches_transformers(E, K, G, TG, norm):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(
        hidden_size=E,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=G,
        topk_group=TG,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    hf = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(E + K)
    with torch.no_grad():
        hf.weight.copy_(torch.eye(E))  # router logits = the input itself
        hf.e_score_correction_bias.copy_(0.5 * torch.randn(E, generator=g))  # some biased scores < 0
    logits = 3 * torch.randn(257, E, generator=g)
    _, ref_w, ref_ids = hf(logits)
    w, ids = route_noaux_tc(logits, hf.e_score_correction_bias, K, G, TG, norm, 2.5)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    # Order within a token's top-k is unspecified: compare sorted by expert id.
    ids_s, order = ids.sort(-1)
    ref_s, ref_order = ref_ids.sort(-1)
    assert torch.equal(ids_s, ref_s)
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)
    if TG < G:  # every chosen expert lies in one of the topk_group kept groups
        for row in ids // (E // G):
            assert len(set(row.tolist())) <= TG


def test_fused_experts_ref_matches_a_token_loop():
    g = torch.Generator().manual_seed(0)
    T, D, I, E, K = 11, 16, 8, 6, 2
    x = torch.randn(T, D, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    weights = torch.rand(T, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    want = torch.zeros(T, D)
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            gate, up = (w13[e] @ x[t]).split(I)
            want[t] += weights[t, k] * (w2[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(fused_experts_ref(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)
    # Expert parallel: two ranks of 3 experts each sum to the whole.
    lo = fused_experts_ref(x, w13[:3], w2[:3], weights, ids, expert_offset=0)
    hi = fused_experts_ref(x, w13[3:], w2[3:], weights, ids, expert_offset=3)
    torch.testing.assert_close(lo + hi, want, rtol=1e-5, atol=1e-5)


def test_router_bf16_weight_only_when_exact_and_refreshed_after_loads():
    from mlaserve.config import ModelConfig
    from mlaserve.layers.moe import TopkRouter
    from mlaserve.models.make_random import load_preset

    gate = TopkRouter(ModelConfig.from_hf(load_preset("tiny")))
    gate.weight.data.copy_(torch.randn_like(gate.weight).bfloat16().float())  # as loaded from a bf16 checkpoint
    w16 = gate.bf16_weight()
    assert w16 is not None and w16.dtype == torch.bfloat16 and torch.equal(w16.float(), gate.weight)
    assert gate.bf16_weight() is w16  # cached
    gate.weight.weight_loader(gate.weight, gate.weight.detach() + 1e-3)  # a load of values bf16 cannot hold
    assert gate.bf16_weight() is None


@pytest.mark.parametrize(
    "E,K,G,TG,method",
    [
        (8, 2, 1, 1, "greedy"),
        (64, 6, 1, 1, "greedy"),
        (16, 4, 4, 2, "group_limited_greedy"),
        (32, 6, 8, 3, "group_limited_greedy"),
    ],
)
def test_route_softmax_matches_transformers_v2(E, K, G, TG, method):
    """DeepSeek-V2's routing (layers/moe.py route_softmax) against transformers' DeepseekV2TopkRouter: softmax scores,
    greedy or group_limited_greedy (a group's score is its max), weights times routed_scaling_factor, unnormalised."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from mlaserve.layers.moe import route_softmax

    cfg = transformers.DeepseekV2Config(
        hidden_size=E,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=G,
        topk_group=TG,
        topk_method=method,
        routed_scaling_factor=16.0,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    hf = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        hf.weight.copy_(torch.eye(E))
    logits = 3 * torch.randn(257, E, generator=torch.Generator().manual_seed(E + K))
    _, ref_w, ref_ids = hf(logits)
    w, ids = route_softmax(logits, K, G, TG, False, 16.0)
    ids_s, order = ids.sort(-1)
    ref_s, ref_order = ref_ids.sort(-1)
    assert torch.equal(ids_s, ref_s)
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)
