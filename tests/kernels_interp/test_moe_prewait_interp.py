"""GEMM2's reads before its PDL wait (fused_experts' "prewait"): the routing and, with TMA, its first weight tile
fetched first, the first K step peeled off the loop. Without PDL (the interpreter) the waits are no-ops, so this
checks the code each program runs gives the same bits; the gpu tests run it with PDL on, under CUDA graphs."""

import pytest
import torch

from tests.kernel_checks import poisoned_empty


@pytest.mark.parametrize("tma,no_align,T,S", [(True, True, 1, 2), (True, True, 2, 1), (True, False, 3, 1),
                                              (False, True, 1, 2), (False, False, 5, 0)])
def test_prewait_is_bit_equal(kdev, tma, no_align, T, S):
    from mlaserve.kernels.fused_moe import fused_experts

    dt, D, I, E, K = torch.bfloat16, 128, 128, 8, 2
    x = torch.randn(T, D, device=kdev).to(dt)
    w13 = (torch.randn(E, 2 * I, D, device=kdev) / D**0.5).to(dt)
    w2 = (torch.randn(E, D, I, device=kdev) / I**0.5).to(dt)
    ids = torch.stack([torch.randperm(E, device=kdev)[:K] for _ in range(T)])
    w = torch.rand(T, K, device=kdev) + 0.1
    kw = {}
    if S:
        kw = dict(shared=tuple((torch.randn(*s, device=kdev) / s[1] ** 0.5).to(dt)
                               for s in ((S * I, D), (S * I, D), (D, S * I))))
        ids = torch.cat([ids, E + torch.arange(S, device=kdev).expand(T, S)], 1)
        w = torch.cat([w, torch.ones(T, S, device=kdev)], 1)
    cfg = dict(tma=tma, no_align=no_align, BLOCK_N=16)
    plain = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, prewait=False), **kw)
    with poisoned_empty():
        early = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, prewait=True), **kw)
    assert torch.equal(early, plain)
