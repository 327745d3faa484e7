"""rope_store_kv and rope_q under the interpreter: skipped slots, strided inputs, aliasing."""

import pytest
import torch

from tests.kernel_checks import check_rope_q, check_rope_store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,P,page", [(32, 8, 16), (64, 16, 64)])
def test_rope_store_kv(kdev, dtype, R, P, page):
    check_rope_store_kv(kdev, dtype, T=11, R=R, P=P, page_size=page, num_pages=3)


@pytest.mark.parametrize("alias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_q(kdev, dtype, alias):
    check_rope_q(kdev, dtype, T=5, H=4, P=8, alias=alias)


def test_rope_q_many_heads(kdev):
    check_rope_q(kdev, torch.float32, T=2, H=40, P=16, alias=False)
