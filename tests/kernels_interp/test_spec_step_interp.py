"""The speculative step's bookkeeping kernels (kernels/spec_step.py) equal the torch code their callers run on the
CPU, on random inputs, into poisoned buffers whose rows past the step must stay as they were."""

import pytest
import torch

POISON = -77


def _rand_step(dev, B, N, V=50, hit=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (B, N), generator=g)
    drafts = y[:, :-1].clone()
    miss = torch.rand(B, N - 1, generator=g) > hit
    drafts[miss] = (drafts[miss] + 1) % V  # misses at random positions, so every accepted count occurs
    return y.to(dev), drafts.to(dev)


@pytest.mark.parametrize("B,N", [(1, 2), (7, 2), (5, 3), (9, 4), (3, 6)])
def test_accept_greedy(kdev, B, N):
    from mlaserve.kernels.spec_step import accept_greedy

    y, drafts = _rand_step(kdev, B, N, seed=B * N)
    ref = (drafts == y[:, :-1]).int().cumprod(1).sum(1)
    for d in (drafts, drafts.to(torch.int32), drafts.t().contiguous().t()):  # the last: column stride B
        acc = accept_greedy(y, d, pdl=False)
        assert acc.dtype == torch.int64 and torch.equal(acc, ref)
    assert accept_greedy(y[:0], drafts[:0]).shape == (0,)


@pytest.mark.parametrize("B,N", [(1, 2), (6, 2), (4, 4)])
def test_pack_verified(kdev, B, N):
    from mlaserve.kernels.spec_step import accept_greedy, pack_verified

    y, drafts = _rand_step(kdev, B, N, seed=N)
    acc = accept_greedy(y, drafts)
    nxt = torch.randint(0, 50, (B, N - 1), device=kdev)
    ids, rows = pack_verified(y, acc, nxt, pdl=False)
    assert torch.equal(ids, torch.cat([y.gather(1, acc[:, None]), nxt], dim=1))
    assert torch.equal(rows, torch.cat([y, acc[:, None], nxt], dim=1))


@pytest.mark.parametrize("n,B,N,shifted", [(1, 1, 2, True), (3, 4, 2, True), (5, 8, 4, False), (8, 8, 3, True)])
def test_draft_inputs(kdev, n, B, N, shifted):
    from mlaserve.kernels.spec_step import draft_inputs

    y, drafts = _rand_step(kdev, n, N, seed=n + B)
    acc = torch.randint(0, N, (n,), device=kdev)
    shift = torch.randint(0, N, (n,), device=kdev) if shifted else None
    M = B + 2  # the graph's buffers hold more rows than this bucket
    ext = torch.full((M * N,), POISON, dtype=torch.int64, device=kdev)
    acc_in = torch.full((M,), POISON, dtype=torch.int64, device=kdev)
    base = torch.randint(0, 1000, (M,), device=kdev)
    ref_ext, ref_acc, ref_base = ext.clone(), acc_in.clone(), base.clone()
    if shift is not None:
        ref_base[:n] += shift
    ref_ext[: n * N] = y.reshape(-1)
    ref_acc[:n] = acc
    ref_acc[n:B] = 0
    draft_inputs(y, acc, shift, ext, acc_in, base, B, pdl=False)
    assert torch.equal(ext, ref_ext) and torch.equal(acc_in, ref_acc) and torch.equal(base, ref_base)


@pytest.mark.parametrize("n,R,q,page_size", [(1, 1, 2, 16), (4, 6, 2, 4), (3, 3, 4, 1), (5, 8, 3, 64)])
def test_shift_decode(kdev, n, R, q, page_size):
    """ForwardBatch.shift_decode's torch code (the CPU's) against the kernel, on a batch of R >= n decode requests
    whose positions may cross a page boundary when moved; a request shifted by 0 keeps its (poisoned) slots."""
    from mlaserve.kernels.spec_step import shift_decode

    g = torch.Generator().manual_seed(n * 31 + q)
    max_pages = 12
    table = torch.stack([torch.randperm(100, generator=g)[:max_pages] for _ in range(R)]).to(torch.int32)
    start = torch.randint(0, (max_pages - 2) * page_size, (R,), generator=g)
    pos = (start[:, None] + torch.arange(q)).reshape(-1)
    shift = torch.randint(0, q, (n,), generator=g)
    seq = (start + q).to(torch.int32)
    slots = torch.full((R * q,), POISON, dtype=torch.int64)
    ref_pos, ref_seq, ref_slots = pos.clone(), seq.clone(), slots.clone()
    p = ref_pos[: n * q].view(n, q)
    p += shift[:, None]
    ref_seq[:n] += shift.to(torch.int32)
    page = table[:n].gather(1, p // page_size).long()
    moved = (page * page_size + p % page_size).view(-1)
    ref_slots[: n * q] = torch.where(shift.repeat_interleave(q) != 0, moved, ref_slots[: n * q])
    d = [t.to(kdev) for t in (pos, seq, slots, table, shift)]
    shift_decode(*d, q, page_size, pdl=False)
    assert torch.equal(d[0].cpu(), ref_pos) and torch.equal(d[1].cpu(), ref_seq)
    assert torch.equal(d[2].cpu(), ref_slots)


@pytest.mark.parametrize("B,N,R,r", [(1, 2, 4, 0), (6, 2, 4, 3), (4, 4, 3, 1)])
def test_pack_step(kdev, B, N, R, r):
    """The step graph's pack (engine/spec_graph.py's torch code): the next ids over the verify's, the shifts (0 on
    padding rows), and ring row r of a host ring (pinned on the GPU), the other rows and the words past the step
    untouched."""
    from mlaserve.kernels.spec_step import accept_greedy, pack_step

    y, drafts = _rand_step(kdev, B, N, seed=7 * B + N)
    acc = accept_greedy(y, drafts, pdl=False)
    nxt = torch.randint(0, 50, (B, N - 1), device=kdev)
    base = torch.randint(-1, 3, (B,), device=kdev)  # -1: a padding row
    M, W = B + 2, 2 * N
    ids = torch.full((M * N,), POISON, dtype=torch.int64, device=kdev)
    shift = torch.full((M,), POISON, dtype=torch.int64, device=kdev)
    ring = torch.full((R, M * W), POISON, dtype=torch.int64, pin_memory=kdev != "cpu")
    ref_ids, ref_shift, ref_ring = ids.clone(), shift.clone(), ring.clone()
    ref_ring[r, : B * W] = torch.cat([y, acc[:, None], nxt], dim=1).reshape(-1).cpu()
    ref_ids[: B * N] = torch.cat([y.gather(1, acc[:, None]), nxt], dim=1).reshape(-1)
    ref_shift[:B] = torch.where(base >= 0, acc, 0)
    row = torch.tensor([r], dtype=torch.int32, device=kdev)
    pack_step(y, acc, nxt, base, ids[: B * N].view(B, N), shift, ring, row, pdl=False)
    if kdev != "cpu":
        torch.cuda.synchronize()
    assert torch.equal(ids, ref_ids) and torch.equal(shift, ref_shift) and torch.equal(ring, ref_ring)


@pytest.mark.parametrize("B,K,page_size", [(1, 1, 16), (5, 1, 4), (4, 3, 2), (7, 2, 64)])
def test_draft_positions(kdev, B, K, page_size):
    """DraftGraphs._prepare's torch code (the CPU's) against the kernel: rows past B of every buffer keep their
    poison; padding rows (base -1) get slots -1; positions cross page boundaries."""
    from types import SimpleNamespace

    from mlaserve.kernels.spec_step import draft_positions
    from mlaserve.spec.draft_graph import DraftGraphs

    g = torch.Generator().manual_seed(B * 7 + K)
    p = SimpleNamespace(k=K, device="cpu", draft=SimpleNamespace(hidden_dtype=torch.float32), page_size=page_size)
    p.pdl, p.attn = False, None
    max_pages = 10
    dg = DraftGraphs(p, max_bs=B + 3, max_pages=max_pages, hidden_dim=8)
    M = dg.base.shape[0]
    for t in (dg.ext_pos, dg.ext_slots, dg.ext_seq, dg.rows, dg.dec_pos, dg.dec_slots, dg.dec_seq):
        t.fill_(POISON)
    dg.base.copy_(torch.randint(0, (max_pages - 2) * page_size - K - 2, (M,), generator=g))
    dg.base[torch.randperm(B, generator=g)[: B // 3]] = -1  # padding rows
    dg.acc.copy_(torch.randint(0, K + 1, (M,), generator=g))
    dg.page_table.copy_(torch.stack([torch.randperm(100, generator=g)[:max_pages] for _ in range(M)]))
    outs = ("ext_pos", "ext_slots", "ext_seq", "rows", "dec_pos", "dec_slots", "dec_seq")
    dev = {n: getattr(dg, n).clone().to(kdev) for n in ("base", "acc", "page_table", *outs)}
    dg._prepare(B)
    N = K + 1
    ext = (dev["ext_pos"][: B * N], dev["ext_slots"][: B * N], dev["ext_seq"][:B])
    dec = (dev["dec_pos"][:, :B], dev["dec_slots"][:, :B], dev["dec_seq"][:, :B]) if K > 1 else None
    draft_positions(dev["base"][:B], dev["acc"][:B], dev["page_table"][:B], ext, dev["rows"][:B], dec, N, page_size)
    for n in outs:
        assert torch.equal(dev[n].cpu(), getattr(dg, n)), n
    assert (dg.ext_slots[: B * N].view(B, N)[dg.base[:B] < 0] == -1).all()
