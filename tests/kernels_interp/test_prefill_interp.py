"""prefill_attention (and its SDPA alternative) under the interpreter: odd head dims, prefixes, ragged lengths."""

import pytest
import torch

from tests.kernel_checks import check_prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_dims_with_prefix(kdev, dtype):
    # Dqk = Dv = 24 (tiny preset): 16 + masked 8 for QK, 24 padded to 32 for V. Requests: a fresh prompt, a chunk
    # after a cached prefix, a single token after a prefix, and a prompt longer than one query block.
    check_prefill(kdev, dtype, H=2, Dqk=24, Dv=24, q_lens=[5, 7, 1, 40], k_lens=[5, 30, 12, 40])


def test_real_head_dims_small(kdev):
    # Dqk=192 (128 + 64), Dv=128 as in the real models, a few tokens
    check_prefill(kdev, torch.bfloat16, H=1, Dqk=192, Dv=128, q_lens=[3, 9], k_lens=[3, 20],
                  config=dict(BLOCK_M=16, BLOCK_N=16))


def test_pow2_head_dim_and_small_blocks(kdev):
    # Dqk=32 (no remainder part), block sizes smaller than the lengths: masked and unmasked key loops both run
    check_prefill(kdev, torch.float32, H=3, Dqk=32, Dv=16, q_lens=[37, 16], k_lens=[50, 16], strided_v=False,
                  config=dict(BLOCK_M=16, BLOCK_N=16))


def test_sdpa_alternative(kdev):
    check_prefill(kdev, torch.float32, H=2, Dqk=24, Dv=16, q_lens=[4, 6], k_lens=[9, 6], impl="sdpa")
