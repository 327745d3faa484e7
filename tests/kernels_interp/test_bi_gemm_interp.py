"""bi_gemm (deterministic mode's dense GEMM): each row bit for bit the same at M = 1, 3, 17, 64 and in both forms
(split K through a workspace, or one program per tile adding its chunks), a row's batch entry alike in the batched
form, close to the fp32 torch reference, every element of a NaN-poisoned output written."""

import pytest
import torch

from tests.helpers.kernel_checks import nan_like

MS = (1, 3, 17, 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K", [(48, 80), (64, 128), (40, 336)])
def test_rows_do_not_depend_on_m(kdev, dtype, N, K):
    from mlaserve.kernels.bi_gemm import TILES_16, TILES_32, bi_gemm, k_splits

    x = torch.randn(max(MS), K, device=kdev).to(dtype)
    w = (torch.randn(N, K, device=kdev) / K**0.5).to(dtype)
    ref = x.float() @ w.float().t()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    S, chunk = k_splits(1, N, K, TILES_32 if dtype == torch.float32 else TILES_16)
    if K == 336:  # several chunks, the last one short
        assert S > 1 and S * chunk > K, (S, chunk)
    outs = {}
    for M in MS:
        for split in (False, True):
            out = nan_like((M, N), dtype, kdev)
            bi_gemm(x[:M], w, out=out, split=split)
            assert (out.float() - ref[:M]).abs().max() <= tol * ref.abs().max(), (M, split)
            outs[M, split] = out
    for M in MS:
        for split in (False, True):
            assert torch.equal(outs[M, split], outs[max(MS), False][:M]), (M, split)


def test_k_splits_depend_on_the_weight_alone():
    """One M tile of a decode-sized weight is cut into enough chunks to give every SM work; a wide weight is not."""
    from mlaserve.kernels.bi_gemm import SPLIT_PROGRAMS, TILES_16, k_splits

    for B, N, K in [(1, 576, 2048), (1, 3072, 2048), (1, 2048, 1408), (16, 128, 512), (1, 64, 7168)]:
        S, chunk = k_splits(B, N, K, TILES_16)
        assert S > 1 and chunk % 64 == 0 and (S - 1) * chunk < K <= S * chunk, (B, N, K, S, chunk)
        assert B * (N // 64 or 1) * S <= SPLIT_PROGRAMS, (B, N, K, S)
    assert k_splits(1, 163840, 2048, TILES_16) == (1, 2048)


def test_strided_views_and_fp32_out(kdev):
    """x a column slice, w a transposed view ([K, N] storage), out a strided view; out_dtype float32 (the router)."""
    from mlaserve.kernels.bi_gemm import bi_gemm

    K, N = 64, 40
    big = torch.randn(17, K + 16, device=kdev).to(torch.bfloat16)
    x = big[:, 8 : 8 + K]
    wt = torch.randn(K, N, device=kdev).to(torch.bfloat16)
    w = wt.t()  # [N, K], strides (1, N)
    ref = x.float() @ w.float().t()
    y = bi_gemm(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and (y - ref).abs().max() <= 1e-2 * ref.abs().max()
    buf = nan_like((17, 2 * N), torch.bfloat16, kdev)
    bi_gemm(x, w, out=buf[:, ::2])
    assert torch.equal(buf[:, ::2], y.to(torch.bfloat16)) and buf[:, 1::2].isnan().all()
    buf = nan_like((17, 2 * N), torch.bfloat16, kdev)
    bi_gemm(x, w, out=buf[:, ::2], split=True)
    assert torch.equal(buf[:, ::2], y.to(torch.bfloat16)) and buf[:, 1::2].isnan().all()
    assert torch.equal(bi_gemm(x[:3], w, out_dtype=torch.float32), y[:3])


def test_batched_per_head_rows_do_not_depend_on_t(kdev):
    """The absorbed projections' form: x [H, T, K] @ m [H, K, N] into a [T, H, N] view transposed."""
    from mlaserve.kernels.bi_gemm import bi_gemm

    H, K, N, T = 3, 32, 48, 17
    q = torch.randn(T, H, K, device=kdev).to(torch.bfloat16)
    m = (torch.randn(H, K, N, device=kdev) / K**0.5).to(torch.bfloat16)
    ref = torch.bmm(q.float().transpose(0, 1), m.float()).transpose(0, 1)  # [T, H, N]
    outs = {}
    for t in (1, 3, T):
        for split in (False, True):
            out = nan_like((t, H, N), torch.bfloat16, kdev)
            bi_gemm(q[:t].transpose(0, 1), m.transpose(1, 2), out=out.transpose(0, 1), split=split)
            assert (out.float() - ref[:t]).abs().max() <= 1e-2 * ref.abs().max()
            outs[t, split] = out
    for t, split in outs:
        assert torch.equal(outs[t, split], outs[T, False][:t]), (t, split)


def test_bad_input_names_field(kdev):
    from mlaserve.kernels.bi_gemm import bi_gemm

    x = torch.zeros(2, 16, device=kdev)
    with pytest.raises(ValueError, match="bi_gemm: w"):
        bi_gemm(x, torch.zeros(8, 32, device=kdev))
    with pytest.raises(ValueError, match="bi_gemm: x"):
        bi_gemm(x, torch.zeros(8, 16, device=kdev, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bi_gemm: out"):
        bi_gemm(x, torch.zeros(8, 16, device=kdev), out=torch.empty(2, 9, device=kdev))
    with pytest.raises(ValueError, match="bi_gemm: tiles"):
        bi_gemm(x, torch.zeros(8, 16, device=kdev), tiles=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, num_warps=4))


def test_large_tiles_on_large_grids_keep_the_rows(kdev, monkeypatch):
    """16-bit loop-form launches of >= 128 rows whose grid of 128x128 tiles is large enough take those tiles (the
    bounds lowered here so a small weight reaches them), with the 64x64 tile's K split (3 chunks here): rows equal
    to the split form's at M = 1 and to the 64x64 loop form's, every element written. The GPU suite holds the bits
    at M1's shapes."""
    from mlaserve.kernels import bi_gemm as bg

    monkeypatch.setattr(bg, "LARGE_MIN_PROGRAMS", 2)
    monkeypatch.setattr(bg, "SPLIT_BELOW_PROGRAMS", 4)
    seen = []
    launch = bg._bi_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*a, **k):
                seen.append(k["BLOCK_M"])
                return launch[grid](*a, **k)

            return run

    monkeypatch.setattr(bg, "_bi_gemm_kernel", Spy())
    N, K, M = 256, 336, 160
    x = torch.randn(M, K, device=kdev).to(torch.bfloat16)
    w = (torch.randn(N, K, device=kdev) / K**0.5).to(torch.bfloat16)
    big = bg.bi_gemm(x, w, out=nan_like((M, N), torch.bfloat16, kdev))
    assert seen == [128]
    small = bg.bi_gemm(x, w, tiles=bg.TILES_16)
    one = bg.bi_gemm(x[:1], w, split=True)
    assert seen == [128, 64, 64]
    assert bg.k_splits(1, N, K, bg.TILES_16)[0] == 3
    assert torch.equal(big, small) and torch.equal(big[:1], one)
    ref = x.float() @ w.float().t()
    assert (big.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
