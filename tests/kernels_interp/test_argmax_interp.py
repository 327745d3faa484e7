"""argmax_rows under the interpreter: one and several blocks a row, ties, -inf rows and NaN (helpers/kernel_checks)."""

import pytest
import torch

from tests.helpers.kernel_checks import check_argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,V", [(1, 7), (5, 300), (6, 9000)])
def test_argmax_rows(kdev, dtype, B, V):
    check_argmax(kdev, dtype, B=B, V=V)


def test_argmax_rows_rejects():
    pytest.importorskip("triton")
    from mlaserve.kernels.argmax import argmax_rows

    with pytest.raises(ValueError, match="unit last stride"):
        argmax_rows(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="V=0"):
        argmax_rows(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="offsets"):
        argmax_rows(torch.zeros(3, 6), offsets=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="out"):
        argmax_rows(torch.zeros(3, 6), out=torch.zeros(3, dtype=torch.int32))
