"""The FP8 latent cache's kernels under the interpreter: rope_store_kv and absorb_q_rope_store_kv writing e4m3 rows
(with and without the fused norm, skipped slots, saturation), mla_decode reading them (splits, verify widths), the
tiny model through the Triton backend; tiny model dims."""

import pytest
import torch

from tests.helpers.fp8_kv_checks import check_absorb_store_fp8, check_mla_decode_fp8, check_rope_store_kv_fp8
from tests.helpers.model_backend_check import check_model_backends_fp8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_rope_store_kv_fp8(kdev, dtype, norm, scale):
    check_rope_store_kv_fp8(kdev, dtype, T=7, R=32, P=8, page_size=16, num_pages=3, norm=norm, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T", [1, 2])
def test_absorb_q_rope_store_kv_fp8(kdev, dtype, norm, T):
    check_absorb_store_fp8(kdev, dtype, T=T, H=2, N=16, R=32, P=8, norm=norm, scale=0.37)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len,num_splits", [(1, 1), (1, 3), (2, 2)])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_mla_decode_fp8(kdev, dtype, q_len, num_splits, scale):
    check_mla_decode_fp8(
        kdev,
        dtype,
        ctx_lens=[q_len, 17, 40],
        H=4,
        R=32,
        P=8,
        page_size=16,
        q_len=q_len,
        scale=scale,
        num_splits=num_splits,
        config={"MIN_SPLIT_TOKENS": 16},
    )


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_mla_decode_fp8_tma_tiles(kdev, scale):
    # whole tiles by TMA descriptors over the e4m3 rows (P=32: a 32-byte box row), the last partial tile by pointers
    check_mla_decode_fp8(
        kdev,
        torch.bfloat16,
        ctx_lens=[1, 40, 64],
        H=16,
        R=32,
        P=32,
        page_size=16,
        q_len=1,
        scale=scale,
        num_splits=2,
        config={"TMA": True, "BLOCK_N": 16, "MIN_SPLIT_TOKENS": 16},
    )


def test_kernels_refuse_an_fp8_cache_without_its_scale(kdev):
    from mlaserve.kernels.mla_decode import mla_decode
    from mlaserve.kernels.rope_kv import rope_store_kv

    cache = torch.zeros(2, 16, 40, dtype=torch.float8_e4m3fn, device=kdev)
    q = torch.zeros(1, 4, 40, device=kdev)
    lens, table = torch.ones(1, dtype=torch.int32, device=kdev), torch.zeros(1, 1, dtype=torch.int32, device=kdev)
    with pytest.raises(ValueError, match="kv_scale: a float8_e4m3fn cache needs one"):
        mla_decode(q, cache, table, lens, 1, 1.0, torch.empty(1, 4, 32, device=kdev))
    with pytest.raises(ValueError, match="kv_scale must be 1 fp32 element"):
        mla_decode(q, cache, table, lens, 1, 1.0, torch.empty(1, 4, 32, device=kdev), kv_scale=torch.ones(2))
    c_kv, k_pe, cs = torch.zeros(1, 32), torch.zeros(1, 8), torch.zeros(1, 4)
    slots = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="kv_scale: a float8_e4m3fn cache needs one"):
        rope_store_kv(cache, slots.to(kdev), c_kv.to(kdev), k_pe.to(kdev), cs.to(kdev), cs.to(kdev))
    with pytest.raises(ValueError, match="a torch.float32 none"):
        rope_store_kv(
            cache.float(), slots.to(kdev), c_kv.to(kdev), k_pe.to(kdev), cs.to(kdev), cs.to(kdev), kv_scale=q[0, 0, :1]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_with_an_fp8_cache_matches_torch_ref(kdev, tiny_ckpt, dtype):
    check_model_backends_fp8(tiny_ckpt, kdev, dtype, num_splits=2)


def test_fp8_prefill_context_is_the_dequantized_rows(kdev):
    from mlaserve.attention.base import ForwardBatch, SeqChunk
    from mlaserve.attention.torch_ref import TorchRefBackend
    from mlaserve.attention.triton_mla import TritonMLABackend

    cache = (4 * torch.randn(2, 6, 16, 40, device=kdev)).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.37, 2.0], device=kdev)
    tri = TritonMLABackend(cache, 32, kv_scale=scale, dtype=torch.bfloat16)
    ref = TorchRefBackend(cache, 32, scale, torch.bfloat16)
    batch = ForwardBatch.build([SeqChunk([1], 20, [4, 1])], [SeqChunk([1, 2, 3], 17, [5, 0])], 16, kdev)
    for layer in (0, 1):
        got = tri.prefill_context(layer, batch)
        assert got.dtype == torch.bfloat16 and torch.equal(got, ref.prefill_context(layer, batch))
