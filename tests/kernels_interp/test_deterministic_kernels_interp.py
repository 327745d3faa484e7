"""Deterministic mode's kernel settings hold a request's rows bit for bit whatever shares the launch: MLA decode
with the fixed split cut (KernelConfig.mla_decode_args) and the fused MoE with its fixed tiles (moe_fixed_config),
each also close to its torch reference, outputs NaN-poisoned."""

import pytest
import torch

from tests.helpers.kernel_checks import make_paged, nan_like


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_rows_do_not_depend_on_the_batch(kdev, dtype):
    from dataclasses import replace

    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.mla_decode import mla_decode
    from tests.helpers.kernel_refs import mla_decode_ref

    # tiny contexts: 4 splits of >= 16 tokens, so the cut is exercised (deterministic mode: 32 of >= 256)
    k = replace(KernelConfig().batch_invariant(), mla_num_splits=4, mla_split_tokens=16)
    splits, cfg = k.mla_decode_args()
    H, R, P, ctx = 4, 32, 16, [40, 9, 70, 33]
    kv, table, lens = make_paged(ctx, 16, R + P, dtype, kdev)
    q = torch.randn(len(ctx), H, R + P, device=kdev).to(dtype)

    def run(rows):
        out = nan_like((len(rows), H, R), dtype, kdev)
        return mla_decode(q[rows], kv, table[rows], lens[rows], 1, 0.3, out, num_splits=splits, config=cfg)

    every = run([0, 1, 2, 3])
    ref = mla_decode_ref(q.float(), kv.float(), table, lens, 1, 0.3, R)
    assert (every.float() - ref).abs().max() <= (1e-2 if dtype == torch.bfloat16 else 1e-4) * ref.abs().max()
    for rows in ([0], [2], [3, 0], [2, 1, 0]):
        got = run(rows)
        for i, r in enumerate(rows):
            assert torch.equal(got[i], every[r]), (rows, r)


def test_fused_moe_fixed_tiles_rows_do_not_depend_on_the_step(kdev):
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref
    from tests.helpers.kernel_checks import poisoned_empty

    k = KernelConfig().batch_invariant()
    E, D, I, K, T = 4, 32, 32, 2, 17
    dt = torch.bfloat16
    x = torch.randn(T, D, device=kdev).to(dt)
    w13 = (torch.randn(E, 2 * I, D, device=kdev) / D**0.5).to(dt)
    w2 = (torch.randn(E, D, I, device=kdev) / I**0.5).to(dt)
    ids = torch.stack([torch.randperm(E, device=kdev)[:K] for _ in range(T)])
    wts = torch.rand(T, K, device=kdev)

    def run(n):
        with poisoned_empty():
            return fused_experts(x[:n], w13, w2, wts[:n], ids[:n], config=k.moe_fixed_config(), kernels=k)

    every = run(T)
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), wts, ids)
    assert (every.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    for n in (1, 3):
        assert torch.equal(run(n), every[:n]), n


@pytest.mark.parametrize("n", [2, 3])
def test_verify_rows_equal_decode_rows(kdev, n, monkeypatch):
    """Deterministic mode: the backend's decode of a verify of width n (3 requests, contexts crossing the fixed
    cut) runs as B * n decode rows (q_len 1: the GPU's decode tiles; the interpreter alone cannot tell tiles
    apart) and gives each row exactly what a plain decode step at that row's position gives."""
    from dataclasses import replace

    from mlaserve.attention import triton_mla
    from mlaserve.attention.base import ForwardBatch, SeqChunk
    from mlaserve.attention.triton_mla import TritonMLABackend
    from mlaserve.kernel_config import KernelConfig

    q_lens = []
    real = triton_mla.mla_decode
    monkeypatch.setattr(triton_mla, "mla_decode", lambda *a, **kw: q_lens.append(a[4]) or real(*a, **kw))

    k = replace(KernelConfig().batch_invariant(), mla_num_splits=4, mla_split_tokens=16)
    H, R, P, dt = 4, 32, 16, torch.bfloat16
    cache = torch.randn(2, 12, 16, R + P, device=kdev).to(dt)
    pages = [[3, 7, 1, 9, 0], [5, 2], [11, 4, 6, 8, 10]]
    cached = [40, 15, 62]  # tokens before the verify block
    backend = TritonMLABackend(cache, R, kernels=k)
    verify = ForwardBatch.build([SeqChunk([1] * n, c, p) for c, p in zip(cached, pages)], [], 16, kdev)
    q = torch.randn(len(cached) * n, H, R + P, device=kdev).to(dt)
    for layer in (0, 1):  # layer 1 reuses layer 0's expanded rows
        got = backend.decode(layer, q, 0.3, verify, nan_like((len(cached) * n, H, R), dt, kdev))
        for b, (c, p) in enumerate(zip(cached, pages)):
            for j in range(n):
                step = ForwardBatch.build([SeqChunk([1], c + j, p)], [], 16, kdev)
                row = b * n + j
                want = backend.decode(layer, q[row : row + 1], 0.3, step, nan_like((1, H, R), dt, kdev))
                assert torch.equal(got[row], want[0]), (layer, b, j)
    assert set(q_lens) == {1}


def test_moe_layer_with_shared_experts_fused_rows_do_not_depend_on_the_step(kdev):
    """The MoE block in the mode: the shared experts inside the fused MoE at every step size (routing, the routed
    and shared slots' GEMMs, the sum), each row the same bit for bit alone and among 40, close to the torch path."""
    from mlaserve.kernel_config import KernelConfig
    from tests.kernels_interp.test_shared_fusion_interp import moe_layer

    torch.manual_seed(3)
    k = KernelConfig().batch_invariant()
    layer = moe_layer(2, torch.bfloat16, "triton").to(kdev)
    layer.kernels = k
    ref = moe_layer(2, torch.bfloat16, "torch").to(kdev)
    ref.load_state_dict(layer.state_dict())
    T = 40
    x = torch.randn(T, layer.gate.weight.shape[1], device=kdev).to(torch.bfloat16)
    assert layer.fuse_shared == 2
    fused, fwd = [], layer.experts.forward
    layer.experts.forward = lambda *a, **kw: fused.append("shared" in kw) or fwd(*a, **kw)
    every = layer(x)
    want = ref(x)
    assert (every.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
    for n in (1, 3, 17):
        assert torch.equal(layer(x[:n].clone()), every[:n]), n
    assert fused == [True] * 4  # the shared experts ran inside the fused MoE at every size
