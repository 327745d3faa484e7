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


SPLIT_CFG = dict(BLOCK_M=16, BLOCK_N=16, SPLIT_KEYS=32, MAX_SPLITS=4, SPLIT_MAX_TOKENS=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_few_rows_over_long_contexts(kdev, dtype):
    # Requests: 3 rows over 150 keys (capped at 4 splits of 3 tiles), 1 row over 140 (9 tiles in 4 splits of 3: the
    # last split empty), 20 rows over 60 (two query blocks, cut apart), 1 over 30 and 16 over 16 (one split: written
    # straight to out), beside one another in one step.
    check_prefill_mla(
        kdev,
        dtype,
        H=2,
        N=16,
        P=8,
        Dv=24,
        q_lens=[3, 1, 20, 1, 16],
        k_lens=[150, 140, 60, 30, 16],
        config=SPLIT_CFG,
        split_kv=True,
    )


def test_split_kv_row_results_do_not_depend_on_the_batch(kdev):
    # a block's cut depends on its own request's lengths: a request alone and beside others gives the same bits
    from mlaserve.kernels.prefill_attention import kv_splits, prefill_attention_mla

    torch.manual_seed(0)
    H, N, P, Dv, R = 2, 16, 8, 16, 16

    def run(q_lens, k_lens, seed):
        g = torch.Generator(device="cpu").manual_seed(seed)
        Tp, C = sum(q_lens), sum(k_lens)
        q = torch.randn(Tp, H, N + P, generator=g).to(kdev)
        kv = torch.randn(C, H, N + Dv, generator=g).to(kdev)
        lat = torch.randn(C, R + P, generator=g).to(kdev)
        cu_q = torch.tensor([0] + q_lens, device=kdev).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + k_lens, device=kdev).cumsum(0).to(torch.int32)
        out = torch.full((Tp, H, Dv), float("nan"), device=kdev)
        args = (q, kv[..., :N], lat[:, R:], kv[..., N:], cu_q, cu_k, 0.2, out, max(q_lens))
        return prefill_attention_mla(*args, config=SPLIT_CFG, split_kv=True), q, kv, lat

    alone, q, kv, lat = run([5], [120], 1)
    assert kv_splits(5, 120, SPLIT_CFG) == 4 and kv_splits(5 + 9, 120 + 40, SPLIT_CFG) == 4
    # the same request first in a step of two (the other's rows and keys after it)
    Tp, C = 5 + 9, 120 + 40
    q2 = torch.cat([q, torch.randn(9, H, N + P, device=kdev)])
    kv2 = torch.cat([kv, torch.randn(40, H, N + Dv, device=kdev)])
    lat2 = torch.cat([lat, torch.randn(40, R + P, device=kdev)])
    cu_q = torch.tensor([0, 5, Tp], dtype=torch.int32, device=kdev)
    cu_k = torch.tensor([0, 120, C], dtype=torch.int32, device=kdev)
    out = torch.full((Tp, H, Dv), float("nan"), device=kdev)
    prefill_attention_mla(
        q2, kv2[..., :N], lat2[:, R:], kv2[..., N:], cu_q, cu_k, 0.2, out, 9, config=SPLIT_CFG, split_kv=True
    )
    assert torch.equal(out[:5], alone)


def test_kv_splits_rule():
    from mlaserve.kernels.prefill_attention import MAX_SPLITS, SPLIT_KEYS, SPLIT_MAX_TOKENS, kv_splits

    assert kv_splits(32, SPLIT_KEYS) == 1  # no context longer than one split
    assert kv_splits(32, 4 * SPLIT_KEYS) == 4
    assert kv_splits(32, 1000 * SPLIT_KEYS) == MAX_SPLITS
    assert kv_splits(SPLIT_MAX_TOKENS + 1, 1000 * SPLIT_KEYS) == 1  # enough query blocks: no split


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


def test_gluon_form_declines_what_it_does_not_compute():
    # the Gluon kernel (sm_90, bf16, MLA's head dims) declines CPU tensors, and the backend keeps the Triton kernel
    from mlaserve.kernels.prefill_attention_gluon import supported

    q = torch.zeros(8, 2, 192, dtype=torch.bfloat16)
    kv = torch.zeros(8, 2, 256, dtype=torch.bfloat16)
    latent = torch.zeros(8, 576, dtype=torch.bfloat16)
    assert not supported(q, kv[..., :128], latent[:, 512:], kv[..., 128:], torch.zeros(8, 2, 128, dtype=torch.bfloat16))
