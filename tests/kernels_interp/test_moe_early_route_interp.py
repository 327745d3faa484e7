"""The decode MoE's reads before its PDL waits (fused_experts' "prewait", and route= for GEMM1), under the
interpreter or compiled: GEMM1 routing its own pairs from the route kernel's RouteSource, and both GEMMs' first
K steps peeled before the wait, give the same bits as the plain kernels. (Without PDL the waits are no-ops, so
this checks the code each program runs; tests/gpu checks the same with PDL on, under CUDA graphs.)"""

import pytest
import torch

from tests.kernel_checks import poisoned_empty


@pytest.mark.parametrize("T,E,G,TG,K,S,offset,split", [
    (1, 16, 1, 1, 4, 2, 0, 4),  # Moonlight's form: split-K router partials, 2 shared slots
    (2, 16, 4, 2, 3, 1, 0, 1),  # groups, 2 tokens, plain [T, E] logits
    (1, 16, 1, 1, 4, 1, 8, 2),  # expert parallel: experts 8..15 are this rank's, the rest skipped
])
def test_gemm1_routes_itself(kdev, T, E, G, TG, K, S, offset, split):
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.routing import route_noaux_tc_logits

    dt, D, I = torch.bfloat16, 128, 128
    E_local = E - offset
    x = torch.randn(T, D, device=kdev).to(dt)
    w13 = (torch.randn(E_local, 2 * I, D, device=kdev) / D**0.5).to(dt)
    w2 = (torch.randn(E_local, D, I, device=kdev) / I**0.5).to(dt)
    shared = tuple((torch.randn(*s, device=kdev) / s[1] ** 0.5).to(dt) for s in ((S * I, D), (S * I, D), (D, S * I)))
    logits = torch.randn(split, T, E, device=kdev) if split > 1 else torch.randn(T, E, device=kdev)
    bias = 0.1 * torch.randn(E, device=kdev)
    w, ids, src = route_noaux_tc_logits(logits, bias, K, G, TG, True, 2.5, S, offset + E_local, with_source=True)
    assert src.meta["SPLIT"] == split and src.shared_id0 == offset + E_local and src.logits.shape == (T, E)
    cfg = dict(tma=True, no_align=True, BLOCK_N=16)
    plain = fused_experts(x, w13, w2, w, ids, offset, config=dict(cfg, prewait=False), shared=shared)
    with poisoned_empty():
        early = fused_experts(x, w13, w2, w, ids, offset, config=dict(cfg, prewait=True), shared=shared, route=src)
    assert torch.equal(early, plain)
    # prewait alone (GEMM2's peeled first step, GEMM1 reading the ids) is the same bits too
    assert torch.equal(fused_experts(x, w13, w2, w, ids, offset, config=dict(cfg, prewait=True), shared=shared),
                       plain)


def test_route_is_ignored_where_gemm1_cannot_use_it(kdev):
    """Pointer loads or the aligned blocks: route= changes nothing (GEMM1 reads the ids as always)."""
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.routing import route_noaux_tc_logits

    dt, D, I, E, K, T = torch.bfloat16, 128, 128, 8, 2, 3
    x = torch.randn(T, D, device=kdev).to(dt)
    w13 = (torch.randn(E, 2 * I, D, device=kdev) / D**0.5).to(dt)
    w2 = (torch.randn(E, D, I, device=kdev) / I**0.5).to(dt)
    w, ids, src = route_noaux_tc_logits(torch.randn(T, E, device=kdev), torch.zeros(E, device=kdev), K, 1, 1, True,
                                        1.0, with_source=True)
    for cfg in (dict(tma=False, no_align=True), dict(tma=True, no_align=False)):
        cfg = dict(cfg, BLOCK_N=16, prewait=True)
        assert torch.equal(fused_experts(x, w13, w2, w, ids, 0, config=cfg, route=src),
                           fused_experts(x, w13, w2, w, ids, 0, config=cfg))
