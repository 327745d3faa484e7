"""The tiny model through TritonMLABackend (+ the Triton MoE) gives TorchRefBackend's logits (interpreter)."""

import pytest
import torch

from tests.model_backend_check import check_model_backends


@pytest.mark.parametrize("dtype,moe_impl", [(torch.float32, "triton"), (torch.bfloat16, "triton")])
def test_model_logits_match_torch_ref(kdev, tiny_ckpt, dtype, moe_impl):
    check_model_backends(tiny_ckpt, kdev, dtype, moe_impl, num_splits=2)  # few splits: the interpreter is slow


def test_prefill_context_matches_ref_and_refreshes_per_forward(kdev):
    from mlaserve.attention.base import ForwardBatch, SeqChunk
    from mlaserve.attention.torch_ref import TorchRefBackend
    from mlaserve.attention.triton_mla import TritonMLABackend

    cache = torch.randn(2, 6, 16, 40, device=kdev)
    tri, ref = TritonMLABackend(cache, 32), TorchRefBackend(cache, 32)
    batch = ForwardBatch.build([SeqChunk([1], 20, [4, 1])], [SeqChunk([1, 2, 3], 17, [5, 0]), SeqChunk([7], 0, [3])],
                               16, kdev)
    for layer in (0, 1):  # layer 1 reuses layer 0's metadata
        assert torch.equal(tri.prefill_context(layer, batch), ref.prefill_context(layer, batch))
    batch.page_table[1, 0] = 2  # the same batch object refilled for a new forward: layer 0 again recomputes
    assert torch.equal(tri.prefill_context(0, batch), ref.prefill_context(0, batch))
