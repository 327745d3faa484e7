"""stack_rows + linear_many: one GEMM for layers that read the same input, under their own HF names; the same
result as running each layer, also after the stack is broken (p.data = ..., .to())."""

import torch

from mlaserve.layers.linear import Linear, linear_many, stack_rows


def test_stacked_layers_share_one_gemm_and_keep_their_names():
    torch.manual_seed(0)
    a, b = Linear(16, 12), Linear(16, 5)
    stack_rows(a, b)
    for p in (a.weight, b.weight):
        p.data.normal_()  # in place, as the loader and init_dummy_weights write
    assert b.weight.data_ptr() == a.weight.data_ptr() + 12 * 16 * a.weight.element_size()
    x = torch.randn(3, 16)
    ya, yb = linear_many(x, a, b)
    assert ya.shape == (3, 12) and yb.shape == (3, 5)
    assert ya.untyped_storage().data_ptr() == yb.untyped_storage().data_ptr()  # one output tensor
    torch.testing.assert_close(ya, a(x))
    torch.testing.assert_close(yb, b(x))
    assert [n for n, _ in torch.nn.ModuleDict(dict(a=a, b=b)).named_parameters()] == ["a.weight", "b.weight"]


def test_broken_stack_falls_back_to_one_gemm_each():
    a, b = Linear(8, 4), Linear(8, 4)
    stack_rows(a, b)
    b.weight.data = torch.randn(4, 8)  # re-pointed: no longer after a's rows
    a.weight.data.normal_()
    x = torch.randn(2, 8)
    ya, yb = linear_many(x, a, b)
    torch.testing.assert_close(ya, a(x))
    torch.testing.assert_close(yb, b(x))


def test_adjacent_but_separate_tensors_are_not_a_stack():
    """Two tensors cut from one buffer but re-pointed to separate storages that happen to sit back to back
    (the CUDA caching allocator does this) must not be read as one."""
    a, b = Linear(8, 4), Linear(8, 4)
    buf = torch.randn(8, 8)
    a.weight.data = buf[:4].clone()
    b.weight.data = buf[4:].clone()
    x = torch.randn(2, 8)
    ya, yb = linear_many(x, a, b)
    torch.testing.assert_close(ya, a(x))
    torch.testing.assert_close(yb, b(x))
