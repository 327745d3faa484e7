"""kernels/ngram.py (NGRAM's append and lookup) against spec/ngram.py's ngram_drafts_ref: the same drafts, rows and
counters from the same random inputs, with padding rows, shifts, predictions and stale tokens past each context."""

import random

import pytest
import torch


@pytest.mark.parametrize("k,lo,hi,V", [(1, 1, 3, 3), (3, 2, 4, 4), (2, 5, 5, 2), (4, 1, 1, 50), (2, 3, 12, 2)])
def test_ngram_kernel_equals_reference(kdev, k, lo, hi, V):
    from mlaserve.kernels.ngram import ngram_drafts
    from mlaserve.spec.ngram import ngram_drafts_ref

    rng = random.Random(k * 100 + hi)
    g = torch.Generator().manual_seed(k)
    S, C, P, N = 9, 1200, 700, k + 1
    for trial in range(12):
        hist = torch.randint(0, V, (S, C), generator=g, dtype=torch.int32)
        pred = torch.randint(0, V, (S, P), generator=g, dtype=torch.int32)
        pred_lens = torch.tensor([rng.choice([0, 0, 1, rng.randrange(P)]) for _ in range(S)], dtype=torch.int64)
        B = rng.randrange(1, 8)
        slots = torch.tensor(rng.sample(range(S), B), dtype=torch.int64)
        shift = torch.tensor([rng.randrange(N) for _ in range(B)], dtype=torch.int64)
        # contexts from 2 tokens to past a block of 512 and the row's end; some padding rows (-1)
        base = torch.tensor(
            [rng.choice([-1, 0, rng.randrange(C - 2 * N - 2), C - 2 * N - 2]) for _ in range(B)], dtype=torch.int64
        )
        shift = torch.where(base >= 0, shift, 0)
        base = torch.where(base >= 0, (base - shift).clamp(min=0), -1)
        acc = torch.tensor([rng.randrange(N) for _ in range(B)], dtype=torch.int64)
        y = torch.randint(0, V, (B, N), generator=g, dtype=torch.int64)
        use_shift = trial % 2 == 0
        if not use_shift:
            base, shift = torch.where(base >= 0, base + shift, -1), None
        out = []
        for f in (ngram_drafts_ref, ngram_drafts):
            h, c = hist.clone().to(kdev), torch.zeros(2, dtype=torch.int64, device=kdev)
            args = (h, pred.to(kdev), pred_lens.to(kdev), slots.to(kdev), base.to(kdev), acc.to(kdev), y.to(kdev))
            d = f(*args, k, lo, hi, c, shift=None if shift is None else shift.to(kdev))
            out.append((d.cpu(), h.cpu(), c.cpu()))
        (d0, h0, c0), (d1, h1, c1) = out
        live = base >= 0
        assert torch.equal(d0[live], d1[live]), (trial, d0, d1)
        assert torch.equal(h0, h1) and torch.equal(c0, c1), trial
        assert c0[0] == k * int(live.sum())
