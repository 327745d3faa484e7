"""GEMM2's reads before its PDL wait (fused_experts' "prewait"): the routing and, with TMA, its first weight tile
fetched first, the first K step peeled off the loop. Without PDL (the interpreter) the waits are no-ops, so this
checks the code each program runs gives the same bits; the gpu tests run it with PDL on, under CUDA graphs."""

import pytest
import torch

from tests.kernel_checks import decode_moe_inputs, poisoned_empty


@pytest.mark.parametrize("tma,no_align,T,S", [(True, True, 1, 2), (True, True, 2, 1), (True, False, 3, 1),
                                              (False, True, 1, 2), (False, False, 5, 0)])
def test_prewait_is_bit_equal(kdev, tma, no_align, T, S):
    from mlaserve.kernels.fused_moe import fused_experts

    x, w13, w2, w, ids, kw = decode_moe_inputs(kdev, T=T, D=128, I=128, E=8, K=2, S=S)
    cfg = dict(tma=tma, no_align=no_align, BLOCK_N=16)
    plain = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, prewait=False), **kw)
    with poisoned_empty():
        early = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, prewait=True), **kw)
    assert torch.equal(early, plain)


@pytest.mark.parametrize("tma,T,S,prewait", [(True, 1, 2, 2), (True, 2, 1, 3), (True, 1, 2, 3), (False, 1, 2, 1)])
def test_early_shared_and_prewait_tiles_are_bit_equal(kdev, tma, T, S, prewait):
    """GEMM1's shared-slot programs before their wait (early_shared) and GEMM2's first 2-3 weight tiles before its
    wait: the same tiles summed in the same order, so the same bits as neither."""
    from mlaserve.kernels.fused_moe import fused_experts

    x, w13, w2, w, ids, kw = decode_moe_inputs(kdev, T=T, D=128, I=384, E=8, K=2, S=S)
    cfg = dict(tma=tma, no_align=True, BLOCK_N=16)
    plain = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, prewait=False, early_shared=False), **kw)
    with poisoned_empty():
        early = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, prewait=prewait, early_shared=True), **kw)
    assert torch.equal(early, plain)


@pytest.mark.parametrize("tma", [True, False])
def test_early_shared_recomputes_when_the_slots_are_not_last(kdev, tma):
    """early_shared guesses that the last S columns of topk_ids are the shared slots (the routing's layout); with
    another layout the programs it guessed wrong for recompute after the wait, so the result is still exact."""
    from mlaserve.kernels.fused_moe import fused_experts

    x, w13, w2, w, ids, kw = decode_moe_inputs(kdev, T=2, D=128, I=128, E=8, K=2, S=2)
    perm = torch.tensor([2, 0, 3, 1], device=ids.device)  # shared slots in columns 0 and 2
    ids, w = ids[:, perm].contiguous(), w[:, perm].contiguous()
    cfg = dict(tma=tma, no_align=True, BLOCK_N=16)
    plain = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, early_shared=False), **kw)
    early = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, early_shared=True), **kw)
    assert torch.equal(early, plain)
