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


def _ref(q, cache, table, seq_lens, q_len, scale):
    """fp32 attention of each token over the positions it sees, gathered from the pages."""
    T, H, D = q.shape
    kvh, ps = cache.shape[3], cache.shape[1]
    out = torch.zeros(T, H, D)
    for t in range(T):
        b, j = divmod(t, q_len)
        n = int(seq_lens[b]) - q_len + j + 1
        if n <= 0:
            continue
        pos = torch.arange(n)
        rows = cache[table[b, pos // ps].long(), pos % ps].float()  # [n, 2, kvh, D]
        k, v = rows[:, 0].repeat_interleave(H // kvh, 1), rows[:, 1].repeat_interleave(H // kvh, 1)  # [n, H, D]
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[t].float(), k) * scale, dim=-1)
        out[t] = torch.einsum("hn,nhd->hd", p, v)
    return out


@pytest.mark.parametrize("H,KVH,q_len", [(4, 2, 1), (4, 2, 3), (2, 2, 2), (8, 1, 1)])
@pytest.mark.parametrize("splits", [None, 1, 3, 32])
def test_gqa_split_kv_matches_fp32_reference(kdev, H, KVH, q_len, splits):
    """Split-KV over long and short contexts (splits past a short context stay empty), one request padded to no
    context at all (its rows are 0), every element of a NaN-poisoned output written; bf16 in, close to fp32."""
    from mlaserve.kernels.gqa_decode import gqa_decode

    from ..helpers.kernel_checks import nan_like

    torch.manual_seed(7 * H + q_len)
    d, ps, P = 32, 16, 64
    ctx = [300, q_len, 1000 // q_len, 0]  # the last a padded request
    seq_lens = torch.tensor(ctx, dtype=torch.int32, device=kdev)
    table = torch.stack([torch.randperm(P)[: (1024 + ps - 1) // ps] for _ in ctx]).to(torch.int32).to(kdev)
    cache = torch.randn(P, ps, 2, KVH, d, device=kdev).to(torch.bfloat16)
    T = len(ctx) * q_len
    q = torch.randn(T, H, d, device=kdev).to(torch.bfloat16)
    out = nan_like((T, H, d), torch.bfloat16, kdev)
    gqa_decode(q, cache, table, seq_lens, q_len, d**-0.5, out, splits=splits)
    ref = _ref(q.cpu(), cache.cpu(), table.cpu(), seq_lens.cpu(), q_len, d**-0.5)
    assert not out.isnan().any()
    assert (out.float().cpu() - ref).abs().max() < 2e-2, (out.float().cpu() - ref).abs().max()
    assert torch.equal(out[-q_len:].float().cpu(), torch.zeros(q_len, H, d))


@pytest.mark.parametrize("H,KVH", [(4, 2), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_prefill_matches_reference(kdev, H, KVH, dtype):
    """A batch with prefill chunks (one over a cached prefix across scattered pages, one fresh) behind verify-width
    decode rows: the Triton store + gathered-context prefill equals the SDPA reference, the caches equal."""
    from mlaserve.attention.base import ForwardBatch, SeqChunk
    from mlaserve.attention.mha_ref import PagedMHARef
    from mlaserve.attention.triton_mha import TritonPagedMHA

    torch.manual_seed(H + KVH)
    d, ps = 16, 16
    caches = [torch.randn(12, ps, 2, KVH, d, device=kdev).to(dtype) for _ in range(2)]
    caches[1].copy_(caches[0])
    decode = [SeqChunk([1, 2], 20, [9, 0], "all"), SeqChunk([3, 4], 3, [4], "all")]
    prefill = [SeqChunk(list(range(45)), 19, [7, 2, 10, 5], "last"), SeqChunk(list(range(30)), 0, [1, 3], "none")]
    batch = ForwardBatch.build(decode, prefill, ps, kdev)
    T = batch.num_tokens
    q = torch.randn(T, H, d, device=kdev).to(dtype)
    k, v = torch.randn(T, KVH, d, device=kdev).to(dtype), torch.randn(T, KVH, d, device=kdev).to(dtype)
    ref = PagedMHARef(caches[0]).forward(q, k, v, 0.25, batch)
    out = TritonPagedMHA(caches[1]).forward(q, k, v, 0.25, batch)
    assert torch.equal(caches[0], caches[1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert not out.isnan().any()
    assert ((out.float() - ref.float()).norm() / ref.float().norm()) < tol
