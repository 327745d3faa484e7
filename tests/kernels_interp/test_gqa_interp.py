"""The draft's paged GQA store + decode kernels equal the SDPA reference (PagedMHARef), verify-width blocks included."""

import pytest
import torch


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_decode_matches_reference(kdev, q_len, dtype):
    from mlaserve.attention.base import ForwardBatch, SeqChunk
    from mlaserve.attention.mha_ref import PagedMHARef
    from mlaserve.attention.triton_mha import TritonPagedMHA

    torch.manual_seed(q_len)
    H, KVH, d, ps = 4, 2, 16, 16
    ctx = [5, 37, 16]
    pages = [[3, 0, 7], [1, 2, 4], [5, 6]]
    caches = [torch.randn(8, ps, 2, KVH, d, device=kdev).to(dtype) for _ in range(2)]
    caches[1].copy_(caches[0])
    chunks = [SeqChunk(list(range(q_len)), n, p, "all") for n, p in zip(ctx, pages)]
    batch = ForwardBatch.build(chunks, [], ps, kdev)
    T = len(ctx) * q_len
    q = torch.randn(T, H, d, device=kdev).to(dtype)
    k, v = torch.randn(T, KVH, d, device=kdev).to(dtype), torch.randn(T, KVH, d, device=kdev).to(dtype)
    ref = PagedMHARef(caches[0]).forward(q, k, v, 0.25, batch)
    out = TritonPagedMHA(caches[1]).forward(q, k, v, 0.25, batch)
    assert torch.equal(caches[0], caches[1])  # the same slots written with the same values
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert not out.isnan().any()
    assert ((out.float() - ref.float()).norm() / ref.float().norm()) < tol
