"""A scalar comparison broadcast into a block mask (mla_decode's `row_ok & nonempty`) loads and stores like the
compiled kernel on every supported Triton: the conftest's int1 typing of the interpreter's comparisons (Triton 3.9's
interpreter refuses the int32 mask it otherwise builds)."""

import pytest
import torch


@pytest.mark.parametrize("start,end", [(0, 5), (5, 5), (7, 3)])
def test_scalar_comparison_in_block_masks(kdev, start, end):
    import triton
    import triton.language as tl

    @triton.jit
    def copy_if(X, Y, n, start, end, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        row_ok = offs < n
        nonempty = start < end  # a scalar i1
        x = tl.load(X + offs, mask=row_ok & nonempty, other=-1.0)
        tl.store(Y + offs, x, mask=nonempty & row_ok)
        tl.store(Y + BLOCK + offs, x, mask=start < end)

    x = torch.arange(8, dtype=torch.float32, device=kdev)
    y = torch.full((16,), float("nan"), device=kdev)
    copy_if[(1,)](x, y, 6, start, end, BLOCK=8)
    want = torch.full((16,), float("nan"))
    if start < end:
        want[:6] = x[:6].cpu()
        want[8:] = torch.tensor([0, 1, 2, 3, 4, 5, -1, -1], dtype=torch.float32)
    torch.testing.assert_close(y.cpu(), want, equal_nan=True)
