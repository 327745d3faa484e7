"""gemv (decode-size x @ W^T) against F.linear in fp32: ragged N and K, 1..16 rows, a strided output buffer."""

import pytest
import torch

from tests.kernel_checks import assert_close, nan_like


@pytest.mark.parametrize("M,N,K,cfg", [(1, 48, 64, None), (3, 40, 96, dict(BLOCK_N=16, BLOCK_K=32)),
                                       (16, 33, 80, dict(BLOCK_N=32, BLOCK_K=64, num_stages=2))])
def test_gemv_matches_linear(kdev, M, N, K, cfg):
    from mlaserve.kernels.gemv import gemv

    x = torch.randn(M, K, device=kdev).to(torch.bfloat16)
    w = (torch.randn(N, K, device=kdev) / K**0.5).to(torch.bfloat16)
    out = nan_like((M, N + 8), torch.bfloat16, kdev)[:, 3:N + 3]  # a column view of a wider buffer
    gemv(x, w, out, config=cfg)
    assert_close(out, x.float() @ w.float().T, torch.bfloat16, f"gemv M={M} N={N} K={K} {cfg}")


def test_gemv_bad_input_names_field(kdev):
    from mlaserve.kernels.gemv import gemv

    w = torch.zeros(8, 32, device=kdev, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(torch.zeros(17, 32, device=kdev, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="must be \\[M, K\\] and \\[N, K\\]"):
        gemv(torch.zeros(1, 16, device=kdev, dtype=torch.bfloat16), w)
