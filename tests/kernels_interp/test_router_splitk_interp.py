"""The router GEMM as split-K partials, summed inside the routing kernel (the decode path of route_noaux_tc_fused)."""

import pytest
import torch


@pytest.mark.parametrize("T,E,D", [(1, 64, 256), (5, 16, 200), (20, 32, 128)])
def test_router_partials_sum_to_the_gemm(kdev, T, E, D):
    from mlaserve.kernels.routing import router_partials

    x = torch.randn(T, D, device=kdev).to(torch.bfloat16)
    w = (0.1 * torch.randn(E, D, device=kdev)).to(torch.bfloat16)
    part = router_partials(x, w)
    assert part.dim() == 3 and part.shape[1:] == (T, E) and part.dtype == torch.float32
    ref = x.float() @ w.float().t()
    torch.testing.assert_close(part.sum(0), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scoring_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("n_group,topk_group,num_shared", [(1, 1, 0), (4, 2, 2)])
def test_routing_from_partials_equals_routing_from_logits(kdev, n_group, topk_group, num_shared, scoring_func):
    from mlaserve.kernels.routing import route_noaux_tc_logits, router_partials
    from tests.helpers import kernel_checks as kc
    from tests.helpers.kernel_checks import nan_like

    T, E, D = 7, 32, 192
    x = torch.randn(T, D, device=kdev).to(torch.bfloat16)
    w = (0.1 * torch.randn(E, D, device=kdev)).to(torch.bfloat16)
    bias = 0.01 * torch.randn(E, device=kdev)
    part = router_partials(x, w)
    logits = nan_like((T, E), torch.float32, kdev)
    logits.copy_(part[0])
    for s in range(1, part.shape[0]):  # the kernel's order: partial 0, then + 1, + 2, ...
        logits += part[s]
    if scoring_func == "softmax":  # DeepSeek-V2: no correction bias
        bias.zero_()
    args = (bias, 4, n_group, topk_group, True, 2.5, num_shared, E)
    with kc.poisoned_empty():
        w1, i1 = route_noaux_tc_logits(part, *args, scoring_func=scoring_func)
        w2, i2 = route_noaux_tc_logits(logits, *args, scoring_func=scoring_func)
    assert torch.equal(i1, i2)
    assert torch.equal(w1, w2)


def test_bad_partials_name_the_limit(kdev):
    from mlaserve.kernels.routing import route_noaux_tc_logits, router_partials

    with pytest.raises(ValueError, match="SPLIT <= 64"):
        route_noaux_tc_logits(torch.zeros(65, 2, 8, device=kdev), torch.zeros(8, device=kdev), 2, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="E <= 1024"):
        router_partials(
            torch.zeros(2, 8, dtype=torch.bfloat16, device=kdev), torch.zeros(8, 16, dtype=torch.bfloat16, device=kdev)
        )


def _check_against_reference(w, ids, x, wt, bias, K, G, TG, S, shared_id0):
    """The routed columns against layers.moe.route_noaux_tc on the fp32 GEMM (near ties aside), and the shared ones."""
    from mlaserve.layers.moe import route_noaux_tc
    from tests.helpers.kernel_checks import _near_tie

    T = x.shape[0]
    logits = x.float() @ wt.float().t()
    rw, rids = route_noaux_tc(logits, bias, K, G, TG, True, 2.5)
    if S:
        assert torch.equal(ids[:, K:], torch.arange(shared_id0, shared_id0 + S, device=x.device).expand(T, S))
        assert torch.equal(w[:, K:], torch.ones(T, S, device=x.device))
    ids_s, o = ids[:, :K].sort(-1)
    rids_s, ro = rids.sort(-1)
    same = (ids_s == rids_s).all(-1)
    choice = logits.sigmoid() + bias
    assert all(_near_tie(choice[t], G, TG, K) for t in (~same).nonzero().reshape(-1).tolist())
    torch.testing.assert_close(w[:, :K].gather(1, o)[same], rw.gather(1, ro)[same], rtol=1e-5, atol=1e-6)


# Moonlight (64 experts, top-6, no groups, 2 shared) and DeepSeek-V3 (256 experts, top-8, 8 groups keep 4, 1 shared)
# at small D; D = 2176 gives 17 splits of two K blocks each.
@pytest.mark.parametrize(
    "E,K,G,TG,S,D", [(64, 6, 1, 1, 0, 384), (64, 6, 1, 1, 2, 2176), (256, 8, 8, 4, 0, 256), (256, 8, 8, 4, 1, 320)]
)
def test_route_splitk_against_reference(kdev, E, K, G, TG, S, D):
    """route_splitk (router_partials + the routing kernel) against the torch reference at decode sizes; poisoned
    outputs and partials."""
    from mlaserve.kernels.routing import route_splitk
    from tests.helpers import kernel_checks as kc

    wt = (torch.randn(E, D, device=kdev) / D**0.5).to(torch.bfloat16)
    for T in sorted({1, 2, 5, 32 if E == 64 else 4}):
        x = torch.randn(T, D, device=kdev).to(torch.bfloat16)
        bias = 0.1 * torch.randn(E, device=kdev)
        with kc.poisoned_empty():
            w, ids = route_splitk(x, wt, bias, K, G, TG, True, 2.5, S, E)
        assert w.shape == ids.shape == (T, K + S) and not w.isnan().any() and (ids >= 0).all()
        _check_against_reference(w, ids, x, wt, bias, K, G, TG, S, E)
