"""GEMM2's reads before its PDL wait (fused_experts' "prewait"): the routing and, with TMA, its first weight tile
fetched first, the first K step peeled off the loop. Without PDL (the interpreter) the waits are no-ops, so this
checks the code each program runs gives the same bits; the gpu tests run it with PDL on, under CUDA graphs."""

import pytest
import torch

from tests.helpers.kernel_checks import decode_moe_inputs, poisoned_empty


@pytest.mark.parametrize(
    "tma,no_align,T,S",
    [(True, True, 1, 2), (True, True, 2, 1), (True, False, 3, 1), (False, True, 1, 2), (False, False, 5, 0)],
)
def test_prewait_is_bit_equal(kdev, tma, no_align, T, S):
    from mlaserve.kernels.fused_moe import fused_experts

    x, w13, w2, w, ids, kw = decode_moe_inputs(kdev, T=T, D=128, I=128, E=8, K=2, S=S)
    cfg = dict(tma=tma, no_align=no_align, BLOCK_N=16)
    plain = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, prewait=False), **kw)
    with poisoned_empty():
        early = fused_experts(x, w13, w2, w, ids, 0, config=dict(cfg, prewait=True), **kw)
    assert torch.equal(early, plain)
