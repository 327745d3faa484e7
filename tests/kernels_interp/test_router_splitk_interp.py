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


@pytest.mark.parametrize("n_group,topk_group,num_shared", [(1, 1, 0), (4, 2, 2)])
def test_routing_from_partials_equals_routing_from_logits(kdev, n_group, topk_group, num_shared):
    from mlaserve.kernels.routing import route_noaux_tc_logits, router_partials
    from tests.kernel_checks import nan_like

    T, E, D = 7, 32, 192
    x = torch.randn(T, D, device=kdev).to(torch.bfloat16)
    w = (0.1 * torch.randn(E, D, device=kdev)).to(torch.bfloat16)
    bias = 0.01 * torch.randn(E, device=kdev)
    part = router_partials(x, w)
    logits = nan_like((T, E), torch.float32, kdev)
    logits.copy_(part[0])
    for s in range(1, part.shape[0]):  # the kernel's order: partial 0, then + 1, + 2, ...
        logits += part[s]
    args = (bias, 4, n_group, topk_group, True, 2.5, num_shared, E)
    w1, i1 = route_noaux_tc_logits(part, *args)
    w2, i2 = route_noaux_tc_logits(logits, *args)
    assert torch.equal(i1, i2)
    assert torch.equal(w1, w2)


def test_bad_partials_name_the_limit(kdev):
    from mlaserve.kernels.routing import route_noaux_tc_logits, router_partials

    with pytest.raises(ValueError, match="SPLIT <= 64"):
        route_noaux_tc_logits(torch.zeros(65, 2, 8, device=kdev), torch.zeros(8, device=kdev), 2, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="E <= 1024"):
        router_partials(torch.zeros(2, 8, dtype=torch.bfloat16, device=kdev),
                        torch.zeros(8, 16, dtype=torch.bfloat16, device=kdev))


def _check_against_reference(w, ids, x, wt, bias, K, G, TG, S, shared_id0):
    """The routed columns against layers.moe.route_noaux_tc on the fp32 GEMM (near ties aside), and the shared ones."""
    from mlaserve.layers.moe import route_noaux_tc
    from tests.kernel_checks import _near_tie

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
@pytest.mark.parametrize("E,K,G,TG,S,D", [(64, 6, 1, 1, 0, 384), (64, 6, 1, 1, 2, 2176), (256, 8, 8, 4, 0, 256),
                                          (256, 8, 8, 4, 1, 320)])
def test_fused_router_routing_equals_two_kernels(kdev, E, K, G, TG, S, D):
    """route_splitk with counters (one kernel: the last split program of a token block routes it) against the
    router_partials + routing kernels, bit for bit, and against the torch reference; poisoned outputs and partials;
    one counter buffer over every launch, zeros after each."""
    from mlaserve.kernels.routing import ROUTER_FUSED_COUNTERS, route_splitk, router_fused_serves
    from tests import kernel_checks as kc

    limit = max(T for T in range(1, 33) if router_fused_serves(T, E))
    assert limit == (32 if E == 64 else 4)
    counters = torch.zeros(ROUTER_FUSED_COUNTERS, dtype=torch.int32, device=kdev)
    wt = (torch.randn(E, D, device=kdev) / D**0.5).to(torch.bfloat16)
    for T in sorted({1, 2, 5, limit}):
        x = torch.randn(T, D, device=kdev).to(torch.bfloat16)
        bias = 0.1 * torch.randn(E, device=kdev)
        args = (x, wt, bias, K, G, TG, True, 2.5, S, E)
        with kc.poisoned_empty():
            w1, i1 = route_splitk(*args, counters=counters)
            w2, i2 = route_splitk(*args)
        assert counters.tolist() == [0] * ROUTER_FUSED_COUNTERS, f"T={T}: counters left at {counters.tolist()}"
        assert w1.shape == i1.shape == (T, K + S) and not w1.isnan().any() and (i1 >= 0).all()
        assert torch.equal(i1, i2), f"T={T}: fused ids differ from the two-kernel path"
        assert torch.equal(w1, w2), f"T={T}: fused weights differ from the two-kernel path"
        _check_against_reference(w1, i1, x, wt, bias, K, G, TG, S, E)


def test_fused_router_routing_bad_counters_and_switch(kdev, monkeypatch):
    from mlaserve.kernels import routing

    x = torch.zeros(17, 64, dtype=torch.bfloat16, device=kdev)
    w = torch.zeros(8, 64, dtype=torch.bfloat16, device=kdev)
    b = torch.zeros(8, device=kdev)
    for bad in (torch.zeros(2, dtype=torch.int64, device=kdev), torch.zeros(1, dtype=torch.int32, device=kdev)):
        with pytest.raises(ValueError, match="router counters"):
            routing.route_splitk(x, w, b, 2, 1, 1, True, 1.0, counters=bad)
    assert routing.router_fused_serves(1, 64) and not routing.router_fused_serves(0, 64)
    assert not routing.router_fused_serves(routing.ROUTER_FUSED_MAX_TOKENS + 1, 64)
    monkeypatch.setenv("MLASERVE_ROUTER_FUSED", "0")
    routing._fused_env.cache_clear()
    try:
        assert not routing.router_fused_serves(1, 64)
    finally:
        monkeypatch.undo()
        routing._fused_env.cache_clear()
