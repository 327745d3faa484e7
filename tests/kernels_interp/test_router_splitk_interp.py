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
