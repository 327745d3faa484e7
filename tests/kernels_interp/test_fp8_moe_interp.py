"""The FP8 fused MoE (kernels/fp8_moe.py) under the interpreter, against fp8_reference.fp8_fused_experts_ref: the GEMV
form, the tiled grouped GEMMs as W8A16 and W8A8 (aligned blocks and per-pair blocks), expert parallelism, partial
128-blocks in D and I (w13's split scale rows), the shared experts' output added in the sum, the config checks."""

import pytest
import torch

from tests.helpers import fp8_checks as fc

BF, F32 = torch.bfloat16, torch.float32
GEMV = dict(gemv1=dict(BLOCK_N=32, BLOCK_K=128), gemv2=dict(BLOCK_N=64, BLOCK_K=128))  # few programs: fast here


@pytest.mark.parametrize(
    "T,D,I,E_total,E_local,offset,K",
    [
        (1, 200, 48, 8, 8, 0, 2),  # D: 2 column blocks, the second partial; I < 128
        (2, 256, 176, 6, 3, 2, 2),  # EP: experts [2, 5) of 6; I = 176: gate / up each 2 scale rows, one partial
        (4, 128, 160, 8, 8, 0, 4),  # 16 pairs: the most the GEMV form serves by default
        (1, 520, 640, 4, 4, 0, 2),  # D: two steps of two trips and a masked last; I: the first step, one more, a last
    ],
)
def test_gemv_form(kdev, T, D, I, E_total, E_local, offset, K):
    cfg = dict(gemv=GEMV)
    fc.check_fp8_moe(kdev, F32, T=T, D=D, I=I, E_total=E_total, E_local=E_local, offset=offset, K=K, config=cfg)


def test_gemv_form_bf16_with_add(kdev):
    cfg = dict(gemv=GEMV)
    fc.check_fp8_moe(kdev, BF, T=3, D=200, I=48, E_total=8, E_local=8, offset=0, K=2, config=cfg, add=True)


def test_gemv_form_default_tiles(kdev):
    """fp8_moe_gemv_config's own tiles (whole 1024- and 256-column trips, no masks) on a pair of steps."""
    fc.check_fp8_moe(kdev, BF, T=2, D=2048, I=256, E_total=4, E_local=4, offset=0, K=2)


@pytest.mark.parametrize("a8", [False, True])
@pytest.mark.parametrize(
    "T,D,I,E_total,E_local,offset,K,cfg",
    [
        (9, 200, 176, 8, 8, 0, 2, dict(BLOCK_M=16, gemm2=dict(BLOCK_N=64))),
        (20, 256, 160, 6, 3, 2, 2, dict(BLOCK_M=16, gemm2=dict(BLOCK_N=128, BLOCK_K=64))),  # EP, 3 blocks an expert
        (5, 200, 48, 8, 8, 0, 3, dict(no_align=True, gemv=False, BLOCK_M=16)),  # per-pair blocks, tiled
    ],
)
def test_tiled(kdev, a8, T, D, I, E_total, E_local, offset, K, cfg):
    cfg = dict(cfg, a8=a8, gemv=False)
    fc.check_fp8_moe(kdev, F32, T=T, D=D, I=I, E_total=E_total, E_local=E_local, offset=offset, K=K, config=cfg)


@pytest.mark.parametrize("a8", [False, True])
def test_tiled_bf16_with_add(kdev, a8):
    cfg = dict(a8=a8, BLOCK_M=16, gemm2=dict(BLOCK_N=64))
    fc.check_fp8_moe(kdev, BF, T=12, D=256, I=128, E_total=6, E_local=6, offset=0, K=2, config=cfg, add=True)


@pytest.mark.parametrize("dtype", [F32, BF])
def test_tiled_a8_narrow_gemm1(kdev, dtype):
    """W8A8 with GEMM1 tiles narrower than an h group: h written in x's dtype, then quantized (the reference rounds
    it the same way); I not a multiple of the tile, EP."""
    cfg = dict(a8=True, gemv=False, BLOCK_M=16, gemm1=dict(BLOCK_N=64), gemm2=dict(BLOCK_N=64))
    fc.check_fp8_moe(kdev, dtype, T=20, D=256, I=176, E_total=6, E_local=4, offset=1, K=2, config=cfg, add=True)


def test_tiled_multi_program_align_ep(kdev, monkeypatch):
    """Above the single-program align limit (lowered): the histogram + align kernels over chunks; EP."""
    from mlaserve.kernels import moe_align

    monkeypatch.setattr(moe_align, "FUSED_COUNT_MAX", 16)
    monkeypatch.setattr(moe_align, "ALIGN_CHUNK", 16)
    cfg = dict(a8=True, BLOCK_M=16, gemm2=dict(BLOCK_N=64))
    fc.check_fp8_moe(kdev, F32, T=24, D=128, I=128, E_total=12, E_local=5, offset=6, K=3, config=cfg)


def test_forms_and_empty(kdev):
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.fp8_moe import moe_form

    edge = KernelConfig.fp8_a8_min_tokens

    assert moe_form(1, 8, 256) == (True, True, False)  # decode: the GEMV form
    assert moe_form(16, 8, 256) == (False, False, False)  # 128 pairs: aligned tiles, W8A16
    assert moe_form(8192, 8, 256) == (False, False, True)  # prefill: W8A8
    # W8A8 above the edge in tokens, whatever the rows per expert (KernelConfig.fp8_a8_min_tokens says why)
    assert moe_form(edge, 8, 8)[2] is False and moe_form(edge + 1, 1, 256)[2] is True
    assert moe_form(8192, 8, 256, a8_above=8192)[2] is False
    fc.check_fp8_moe(kdev, F32, T=0, D=128, I=128, E_total=4, E_local=4, offset=0, K=2)


def test_plan_tokens_choose_the_form(kdev, monkeypatch):
    """An eager step planned as its padded graph twin: 2 tokens x 2 pairs take the GEMV form alone and the aligned
    tiles planned as 3 tokens (kernels.no_align_max_pairs 5), as the twin does; its rows equal the twin's."""
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels import fp8_moe

    gemv = []
    fn = fp8_moe.fp8_moe_gemv
    monkeypatch.setattr(fp8_moe, "fp8_moe_gemv", lambda *a: (gemv.append(1), fn(*a))[1])
    k = KernelConfig(no_align_max_pairs=5)
    w = fc.make_fp8_experts(kdev, E=4, D=128, I=64)
    ids, tw = fc.moe_routing(kdev, T=3, K=2, E_total=4)
    x = torch.randn(3, 128, device=kdev)
    twin = fp8_moe.fp8_fused_experts(x, *w, tw, ids, kernels=k)
    step = fp8_moe.fp8_fused_experts(x[:2], *w, tw[:2], ids[:2], kernels=k, plan_tokens=3)
    assert not gemv and torch.equal(step, twin[:2])
    fp8_moe.fp8_fused_experts(x[:2], *w, tw[:2], ids[:2], kernels=k)
    assert gemv == [1]


def test_tma_fits_whole_tiles_inside_one_scale_block():
    """The TMA form's K loops read one weight scale a step for the whole tile: its BLOCK_N must divide 128."""
    from mlaserve.kernels.fp8_moe import fp8_moe_config, tma_fits

    c1, c2 = fp8_moe_config(8192, 8, 256, 7168, 2048, a8=True)
    assert tma_fits(7168, 2048, c1, c2)
    assert not tma_fits(7168, 2048, c1, dict(c2, BLOCK_N=256))  # two scale blocks in one GEMM2 tile
    assert not tma_fits(7168, 2000, c1, c2)  # I not whole tiles
    assert not tma_fits(7000, 2048, c1, c2)  # D not whole tiles


def test_checks_name_the_argument(kdev):
    from mlaserve.kernels.fp8_moe import fp8_fused_experts

    w13, s13, w2, s2 = fc.make_fp8_experts(kdev, E=4, D=128, I=48)
    x = torch.randn(3, 128, device=kdev)
    ids, w = fc.moe_routing(kdev, T=3, K=2, E_total=4)
    with pytest.raises(ValueError, match=r"w13_scale_inv / w2_scale_inv must be fp32 \[4, 2, 1\] / \[4, 1, 1\]"):
        fp8_fused_experts(x, w13, s13[:, :1], w2, s2, w, ids)
    with pytest.raises(ValueError, match="w13 and w2 must be float8_e4m3fn"):
        fp8_fused_experts(x, w13.float(), s13, w2, s2, w, ids)
    with pytest.raises(ValueError, match=r"w13 \(4, 96, 128\) / w2 \(4, 128, 40\)"):
        fp8_fused_experts(x, w13, s13, w2[..., :40], s2, w, ids)
    with pytest.raises(ValueError, match="topk_ids/topk_weights"):
        fp8_fused_experts(x, w13, s13, w2, s2, w.double(), ids)
    with pytest.raises(ValueError, match="gemm1.BLOCK_N must divide 128"):
        fp8_fused_experts(x, w13, s13, w2, s2, w, ids, config=dict(gemv=False, a8=True, gemm1=dict(BLOCK_N=96)))
    with pytest.raises(ValueError, match=r"gemm2.BLOCK_Q"):
        fp8_fused_experts(x, w13, s13, w2, s2, w, ids, config=dict(gemv=False, gemm2=dict(BLOCK_Q=16)))
    with pytest.raises(ValueError, match="per-pair blocks only"):
        fp8_fused_experts(x, w13, s13, w2, s2, w, ids, config=dict(no_align=False, gemv=True))
    with pytest.raises(ValueError, match="add"):
        fp8_fused_experts(x, w13, s13, w2, s2, w, ids, add=x[:2], config=dict(gemv=GEMV))


@pytest.mark.parametrize("gemv", [True, False])
def test_fused_norm_equals_sum_then_add_norm(kdev, gemv):
    """norm=(weight, eps, residual): the add + RMSNorm after the MoE fused into the sum gives the bits of the
    unfused output followed by add_rms_norm (the quantized MoE layer's fused path, one rank)."""
    from mlaserve.kernels.fp8_moe import fp8_fused_experts
    from mlaserve.kernels.rmsnorm import add_rms_norm
    from tests.helpers.kernel_checks import poisoned_empty

    T, D, I, E, K = 3, 200, 48, 8, 2
    w13, s13, w2, s2 = fc.make_fp8_experts(kdev, E=E, D=D, I=I)
    x = torch.randn(T, D, device=kdev).to(BF)
    ids, w = fc.moe_routing(kdev, T=T, K=K, E_total=E)
    add = fc.strided_rows(T, D, BF, kdev)
    residual = fc.strided_rows(T, D, BF, kdev)
    nw = (1 + 0.1 * torch.randn(D, device=kdev)).to(BF)
    cfg = dict(gemv=GEMV) if gemv else dict(gemv=False, BLOCK_M=16, gemm2=dict(BLOCK_N=64))
    with poisoned_empty():
        out = fp8_fused_experts(x, w13, s13, w2, s2, w, ids, add=add, config=cfg)
        ref_normed, ref_s = add_rms_norm(out, residual, nw, 1e-6)
        normed, s = fp8_fused_experts(x, w13, s13, w2, s2, w, ids, add=add, norm=(nw, 1e-6, residual), config=cfg)
    assert torch.equal(s, ref_s) and torch.equal(normed, ref_normed)
