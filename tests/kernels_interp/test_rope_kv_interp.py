"""rope_store_kv and rope_q under the interpreter: skipped slots, strided inputs, aliasing."""

import pytest
import torch

from tests.helpers.kernel_checks import check_rope_cos_sin, check_rope_neox, check_rope_q, check_rope_store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,P,page", [(32, 8, 16), (64, 16, 64)])
def test_rope_store_kv(kdev, dtype, R, P, page):
    check_rope_store_kv(kdev, dtype, T=11, R=R, P=P, page_size=page, num_pages=3)
    check_rope_store_kv(kdev, dtype, T=11, R=R, P=P, page_size=page, num_pages=3, norm=True)


@pytest.mark.parametrize("alias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_q(kdev, dtype, alias):
    check_rope_q(kdev, dtype, T=5, H=4, P=8, alias=alias)


def test_rope_q_many_heads(kdev):
    check_rope_q(kdev, torch.float32, T=2, H=40, P=16, alias=False)


@pytest.mark.parametrize("alias", [False, True])
def test_rope_q_several_token_blocks(kdev, alias):
    # H=16, P=64 as the models run it: 4 tokens a program, T=9 leaves a partial last block
    check_rope_q(kdev, torch.bfloat16, T=9, H=16, P=64, alias=alias)


@pytest.mark.parametrize("alias", [False, True])
def test_rope_q_odd_heads_head_major(kdev, alias):
    # H=6 (padded head block), P=12 (padded pairs), x with token stride < head stride
    check_rope_q(kdev, torch.float32, T=7, H=6, P=12, alias=alias, head_major=True)


@pytest.mark.parametrize(
    "T,half,scale,pos_dtype", [(1, 32, 1.0, torch.int64), (37, 32, 1.25, torch.int64), (5, 12, 0.7, torch.int32)]
)
def test_rope_cos_sin(kdev, T, half, scale, pos_dtype):
    # one launch for RotaryEmbedding's five torch ops: several token blocks, padded frequency lanes, int32 positions
    check_rope_cos_sin(kdev, T=T, half=half, scale=scale, pos_dtype=pos_dtype)


@pytest.mark.parametrize("alias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,P", [(5, 6, 16), (3, 3, 12), (70, 2, 64)])
def test_rope_neox(kdev, dtype, alias, T, H, P):
    # the Llama draft's q|k (rotate-half pairs): several heads, a padded half (P=12), several token blocks (T=70)
    check_rope_neox(kdev, dtype, T=T, H=H, P=P, alias=alias)
