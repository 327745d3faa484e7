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


def test_gluon_form_declines_what_it_does_not_compute():
    # the Gluon kernel (sm_90, bf16, MLA's head dims) declines CPU tensors, and the backend keeps the Triton kernel
    from mlaserve.kernels.prefill_attention_gluon import supported

    q = torch.zeros(8, 2, 192, dtype=torch.bfloat16)
    kv = torch.zeros(8, 2, 256, dtype=torch.bfloat16)
    latent = torch.zeros(8, 576, dtype=torch.bfloat16)
    assert not supported(q, kv[..., :128], latent[:, 512:], kv[..., 128:], torch.zeros(8, 2, 128, dtype=torch.bfloat16))


def test_gluon_descriptors_equal_fresh_ones():
    # the descriptors' shared-memory layouts are built once a block shape: every field equals a descriptor built
    # from scratch, for each block the kernel takes, over q, k_nope (a strided view) and k_rope
    g = pytest.importorskip("mlaserve.kernels.prefill_attention_gluon")
    if not g.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    q = torch.zeros(16, 2, 192, dtype=torch.bfloat16)
    kv = torch.zeros(32, 2, 256, dtype=torch.bfloat16)
    kr = torch.zeros(32, 64, dtype=torch.bfloat16)
    for _ in range(2):  # the first call fills the cache, the second reads it
        for t, block in ((q, [128, 128]), (q, [128, 64]), (kv[..., :128], [128, 128]), (kr, [128, 64])):
            fresh = g.TensorDescriptor(
                t, g._desc(t, block).shape, g._desc(t, block).strides, block,
                g.gl.NVMMASharedLayout.get_default_for(block, g.gl.bfloat16),
            )  # fmt: skip
            assert g._desc(t, block) == fresh
