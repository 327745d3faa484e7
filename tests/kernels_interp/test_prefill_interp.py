"""prefill_attention (and its SDPA alternative) under the interpreter: odd head dims, prefixes, ragged lengths."""

import pytest
import torch

from tests.helpers.kernel_checks import check_prefill, check_prefill_mla


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_dims_with_prefix(kdev, dtype):
    # Dqk = Dv = 24 (tiny preset): 16 + masked 8 for QK, 24 padded to 32 for V. Requests: a fresh prompt, a chunk
    # after a cached prefix, a single token after a prefix, and a prompt longer than one query block.
    check_prefill(kdev, dtype, H=2, Dqk=24, Dv=24, q_lens=[5, 7, 1, 40], k_lens=[5, 30, 12, 40])


def test_real_head_dims_small(kdev):
    # Dqk=192 (128 + 64), Dv=128 as in the real models, a few tokens
    check_prefill(
        kdev, torch.bfloat16, H=1, Dqk=192, Dv=128, q_lens=[3, 9], k_lens=[3, 20], config=dict(BLOCK_M=16, BLOCK_N=16)
    )


def test_pow2_head_dim_and_small_blocks(kdev):
    # Dqk=32 (no remainder part), block sizes smaller than the lengths: masked and unmasked key loops both run
    check_prefill(
        kdev,
        torch.float32,
        H=3,
        Dqk=32,
        Dv=16,
        q_lens=[37, 16],
        k_lens=[50, 16],
        strided_v=False,
        config=dict(BLOCK_M=16, BLOCK_N=16),
    )


def test_sdpa_alternative(kdev):
    check_prefill(kdev, torch.float32, H=2, Dqk=24, Dv=16, q_lens=[4, 6], k_lens=[9, 6], impl="sdpa")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_source_tiny_model_dims(kdev, dtype):
    # the tiny preset: N=16, P=8 (padded to 16), V=24 (padded to 32); k_rope shared by the heads (head stride 0).
    # A fresh prompt, a chunk after a cached prefix, one token after a prefix, a prompt of several query blocks.
    check_prefill_mla(kdev, dtype, H=4, N=16, P=8, Dv=24, q_lens=[5, 7, 1, 40], k_lens=[5, 30, 12, 40])


def test_two_source_real_dims_small(kdev):
    # N=128, P=64 (no padding: the unmasked tiles load without any mask), Dv=128
    check_prefill_mla(
        kdev,
        torch.bfloat16,
        H=2,
        N=128,
        P=64,
        Dv=128,
        q_lens=[3, 20],
        k_lens=[3, 37],
        config=dict(BLOCK_M=16, BLOCK_N=16),
    )


@pytest.mark.parametrize("group", [1, 2, 3])
def test_two_source_head_groups_and_blocks(kdev, group):
    # several query blocks x heads x requests in the flat grid; group 3 does not divide H=4 (lowered to 2)
    check_prefill_mla(
        kdev,
        torch.float32,
        H=4,
        N=16,
        P=16,
        Dv=16,
        q_lens=[33, 1, 16],
        k_lens=[50, 17, 16],
        config=dict(BLOCK_M=16, BLOCK_N=16, HEAD_GROUP=group),
    )


def test_two_source_rope_per_head_and_odd_nope(kdev):
    # k_rope [C, H, P] with its own head stride; N=24 not a power of two (padded with masks)
    check_prefill_mla(
        kdev,
        torch.float32,
        H=3,
        N=24,
        P=8,
        Dv=16,
        q_lens=[9, 4],
        k_lens=[9, 21],
        rope_per_head=True,
        config=dict(BLOCK_M=16, BLOCK_N=16),
    )


def test_two_source_shape_errors(kdev):
    from mlaserve.kernels.prefill_attention import prefill_attention_mla

    z = dict(device=kdev)
    q, kn, kr, v = (
        torch.zeros(4, 2, 24, **z),
        torch.zeros(6, 2, 16, **z),
        torch.zeros(6, 8, **z),
        torch.zeros(6, 2, 16, **z),
    )
    cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32, **z), torch.tensor([0, 6], dtype=torch.int32, **z)
    out = torch.zeros(4, 2, 16, **z)
    with pytest.raises(ValueError, match="k_rope"):
        prefill_attention_mla(q, kn, torch.zeros(6, 3, 8, **z), v, cu_q, cu_k, 0.1, out, 4)
    with pytest.raises(ValueError, match="unit stride"):
        prefill_attention_mla(q, kn, torch.zeros(8, 6, **z).t(), v, cu_q, cu_k, 0.1, out, 4)
    prefill_attention_mla(q, kn, kr, v, cu_q, cu_k, 0.1, out, 4)  # the well-formed call runs


@pytest.mark.parametrize("config", [dict(BLOCK_M=16, BLOCK_N=16), None])
def test_two_source_quantized_output(kdev, config):
    """out_q (an FP8 o_proj's input): the bits act_quant gives for the bf16 output, rows padded to a multiple of 4
    with a quantized zero row; poisoned buffers, ragged requests, a cached prefix, 3 heads of Dv = 128."""
    from mlaserve.kernels.fp8_quant import act_quant
    from mlaserve.kernels.prefill_attention import prefill_attention_mla
    from tests.helpers.kernel_checks import nan_like

    torch.manual_seed(7)
    H, N, P, Dv, R = 3, 32, 16, 128, 16
    q_lens, k_lens = [5, 1, 19], [5, 9, 30]
    Tp, C = sum(q_lens), sum(k_lens)
    q = torch.randn(Tp, H, N + P, device=kdev).to(torch.bfloat16)
    kv = torch.randn(C, H, N + Dv, device=kdev).mul(2).to(torch.bfloat16)
    k_rope = torch.randn(C, R + P, device=kdev).to(torch.bfloat16)[:, R:]
    cu_q = torch.tensor([0] + q_lens, device=kdev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, device=kdev).cumsum(0).to(torch.int32)
    args = (q, kv[..., :N], k_rope, kv[..., N:], cu_q, cu_k, (N + P) ** -0.5)
    out = nan_like((Tp, H, Dv), torch.bfloat16, kdev)
    prefill_attention_mla(*args, out, max(q_lens), config=config)
    Tp4 = -(-Tp // 4) * 4
    qo = torch.full((Tp4, H * Dv), float("nan"), device=kdev).to(torch.float8_e4m3fn)
    so = torch.full((H, Tp4), float("nan"), device=kdev).t()
    assert prefill_attention_mla(*args, None, max(q_lens), config=config, out_q=(qo, so)) is None
    qr, sr = act_quant(out.view(Tp, H * Dv), row_align=4)
    assert torch.equal(qo.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(so, sr)
    with pytest.raises(ValueError, match="out_q"):
        prefill_attention_mla(*args, out, max(q_lens), out_q=(qo, so))
