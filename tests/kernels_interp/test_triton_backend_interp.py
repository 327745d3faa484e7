"""The tiny model through TritonMLABackend (+ the Triton MoE) gives TorchRefBackend's logits (interpreter)."""

import pytest
import torch

from tests.model_backend_check import check_model_backends


@pytest.mark.parametrize("dtype,moe_impl", [(torch.float32, "triton"), (torch.bfloat16, "triton")])
def test_model_logits_match_torch_ref(kdev, tiny_ckpt, dtype, moe_impl):
    check_model_backends(tiny_ckpt, kdev, dtype, moe_impl, num_splits=2)  # few splits: the interpreter is slow
