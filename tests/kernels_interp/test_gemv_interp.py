"""The decode GEMV against F.linear in fp32 under the interpreter: 1, 3 and 8 rows, even and masked tiles,
multi-trip K, strided rows, a NaN-poisoned output, and the dispatch rule of layers.linear."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.kernel_checks import assert_close, nan_like


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize(
    "N,K,cfg",
    [
        (24, 64, None),
        (7, 100, None),
        (10, 96, dict(BLOCK_N=4, BLOCK_K=32)),
        (9, 200, dict(BLOCK_N=2, BLOCK_K=64, num_warps=1)),
    ],
)
def test_gemv(kdev, dtype, T, N, K, cfg):
    from mlaserve.kernels.gemv import gemv

    x = torch.randn(T + 2, K + 5, device=kdev).to(dtype)[1 : T + 1, 5:]  # strided rows
    w = torch.randn(N, K + 3, device=kdev).to(dtype)[:, :K]  # strided rows, unit last stride
    out = nan_like((T, N), dtype, kdev)
    assert gemv(x, w, cfg, out=out) is out
    assert_close(out, F.linear(x.float(), w.float()), dtype, f"gemv T={T} N={N} K={K} {cfg}")
    if T > 1:  # each row exactly as the one-row launch computes it
        assert torch.equal(out[1], gemv(x[1:2], w, cfg)[0])


@pytest.mark.parametrize("T", [1, 2])
def test_gemv_fp32_out_is_the_rounded_result(kdev, T):
    """An fp32 `out` (the lm_head's logits) holds the x.dtype result cast to fp32, bit for bit: what
    F.linear(x, w).float() rounds, not the unrounded fp32 sum."""
    from mlaserve.kernels.gemv import gemv

    x = torch.randn(T, 96, device=kdev).to(torch.bfloat16)
    w = torch.randn(40, 96, device=kdev).to(torch.bfloat16)
    out = nan_like((T, 40), torch.float32, kdev)
    assert gemv(x, w, out=out) is out
    assert torch.equal(out, gemv(x, w).float())


def test_gemv_checks(kdev):
    from mlaserve.kernels.gemv import gemv

    x, w = torch.randn(1, 8, device=kdev), torch.randn(4, 8, device=kdev)
    with pytest.raises(ValueError, match=r"\[T, K\] \(1 <= T <= 8\)"):
        gemv(torch.randn(9, 8, device=kdev), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x.double(), w)
    with pytest.raises(ValueError, match=r"contiguous \[1, 4\]"):
        gemv(x, w, out=torch.empty(1, 5, device=kdev))


def test_linear_dispatch_stays_on_f_linear_off_gpu():
    from mlaserve.layers.linear import linear

    x, w = torch.randn(1, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w), F.linear(x, w))  # CPU: F.linear itself


def test_gemv_serves_rule(kdev):
    """layers.linear's dispatch rule: CUDA steps of 1-2 rows in bf16/fp16 times weights of <= gemv_max_bytes
    (KernelConfig's defaults)."""
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.gemv import gemv_serves

    GEMV_MAX_BYTES, GEMV_SERVE_TOKENS = KernelConfig.gemv_max_bytes, KernelConfig.gemv_serve_tokens
    assert GEMV_SERVE_TOKENS == 2

    bf = torch.bfloat16
    w = torch.empty(64, 32, dtype=bf, device=kdev)
    cuda = torch.device(kdev).type == "cuda"
    for T in range(1, GEMV_SERVE_TOKENS + 1):
        assert gemv_serves(torch.empty(T, 32, dtype=bf, device=kdev), w) == cuda
    assert not gemv_serves(torch.empty(GEMV_SERVE_TOKENS + 1, 32, dtype=bf, device=kdev), w)
    assert not gemv_serves(torch.empty(1, 32, device=kdev), w.float())  # fp32
    assert not gemv_serves(torch.empty(1, 64, dtype=bf, device=kdev)[:, ::2], w)  # strided x
    big = torch.empty(1, 32, dtype=bf, device=kdev).expand(GEMV_MAX_BYTES // 2 // 32 + 1, 32)  # > the byte limit
    assert not gemv_serves(torch.empty(1, 32, dtype=bf, device=kdev), big)
