"""arrive_last (kernels/semaphore.py): the last program of each group sums the group's partials, and the counters
are back at 0 after every launch, so one buffer serves launch after launch (a CUDA graph replays it)."""

import torch


def test_arrive_last_reduces_and_resets(kdev):
    from mlaserve.kernels.semaphore import arrival_counters
    from tests.kernels_interp.semaphore_kernel import group_sum as kernel
    G, S = 5, 8
    cnt = arrival_counters(G, kdev)
    for _ in range(3):  # fresh inputs each launch; the counters are reused
        x = torch.randn(G, S, device=kdev)
        part = torch.full((G, S), float("nan"), device=kdev)
        out = torch.full((G,), float("nan"), device=kdev)
        kernel[(G, S)](x, part, out, cnt, S=S)
        torch.testing.assert_close(out, 2 * x.sum(1), rtol=1e-5, atol=1e-5)
        assert cnt.tolist() == [0] * G
