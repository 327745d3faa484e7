"""Sampler: masks, seeds, logprobs."""

import torch

from mlaserve.layers.sampler import SamplingRow, _filter, sample
from mlaserve.types import SamplingParams


def rows(*ps, gens=None):
    return [SamplingRow(p, (gens or [None] * len(ps))[i]) for i, p in enumerate(ps)]


def test_greedy_is_argmax():
    logits = torch.randn(4, 100)
    tok, _ = sample(logits, rows(*[SamplingParams(temperature=0)] * 4))
    assert torch.equal(tok, logits.argmax(-1))


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    keep = lambda p: torch.isfinite(_filter(logits.clone(), rows(p)))[0].tolist()  # noqa: E731
    assert keep(SamplingParams(top_k=2)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.5)) == [True, False, False, False]
    assert keep(SamplingParams(top_p=0.7)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.76)) == [True, True, True, False]
    assert keep(SamplingParams(min_p=0.4)) == [True, True, False, False]
    assert keep(SamplingParams()) == [True] * 4


def test_samples_follow_distribution_and_never_masked():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]])).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    tok, _ = sample(logits, rows(*[SamplingParams(top_k=3)] * 4000), g)
    freq = torch.bincount(tok, minlength=4).float() / 4000
    assert freq[3] == 0 and abs(freq[0] - 0.5) < 0.04 and abs(freq[1] - 0.3) < 0.04


def test_seeded_rows_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    p = SamplingParams(temperature=1.0, seed=7)
    alone, _ = sample(logits[2:3], rows(p, gens=[torch.Generator().manual_seed(7)]))
    batch, _ = sample(
        logits,
        rows(
            *[SamplingParams(temperature=1.0)] * 2,
            p,
            *[SamplingParams(temperature=0.5)] * 2,
            gens=[None, None, torch.Generator().manual_seed(7), None, None],
        ),
        torch.Generator().manual_seed(123),
    )
    assert alone[0] == batch[2]


def test_logprobs_of_sampled_tokens():
    logits = torch.randn(3, 20)
    tok, lp = sample(logits, rows(*[SamplingParams(temperature=0)] * 3), want_logprobs=True)
    assert torch.allclose(lp, logits.log_softmax(-1).max(-1).values)


def test_top_k_one_and_off_values():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    keep = lambda p: torch.isfinite(_filter(logits.clone(), rows(p)))[0].tolist()  # noqa: E731
    assert keep(SamplingParams(top_k=1)) == [True, False, False, False]
    assert keep(SamplingParams(top_k=0)) == keep(SamplingParams(top_k=-1)) == [True] * 4  # 0 and -1: off


def test_min_p_per_row_of_a_batch():
    """min_p's threshold is each row's own max probability times its min_p; a token exactly at it stays."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    out = _filter(logits, rows(SamplingParams(min_p=0.5), SamplingParams(min_p=0.6)))
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [False, False, True, True]]


def test_logprobs_only_when_asked():
    tok, lp = sample(torch.randn(2, 10), rows(*[SamplingParams(temperature=0)] * 2))
    assert lp is None


def test_a_seeded_row_draws_from_its_own_generator_only():
    """Whatever the engine's generator and the global RNG, a row with its own generator gives the same stream."""
    logits = torch.zeros(1, 64)  # uniform: every draw shows which random numbers were used

    def stream(engine_seed, global_seed):
        torch.manual_seed(global_seed)
        own, eng = torch.Generator().manual_seed(5), torch.Generator().manual_seed(engine_seed)
        p = SamplingParams(temperature=1.0, seed=5)
        return [int(sample(logits, rows(p, gens=[own]), eng)[0]) for _ in range(20)]

    assert stream(1, 1) == stream(2, 3)
    unseeded = [int(sample(logits, rows(SamplingParams(temperature=1.0)), torch.Generator().manual_seed(5))[0])]
    assert unseeded[0] == stream(9, 9)[0]  # the engine's generator seeded alike draws the same first token


def test_pending_token_counts_for_the_penalties():
    """The token in flight (overlapped decode) is penalised as if it were already in the output."""
    logits = torch.zeros(1, 8)
    logits[0, 3] = 1.0
    p = SamplingParams(temperature=0, frequency_penalty=2.0)
    assert int(sample(logits, rows(p))[0]) == 3
    assert int(sample(logits, rows(p), pending=torch.tensor([3]))[0]) == 0


def test_top_logprobs_ties_go_to_the_lower_id():
    """Equal logprobs come out lowest id first (which of the tied tokens at the k-th place are taken is topk's)."""
    from mlaserve.layers.sampler import top_logprobs

    logits = torch.zeros(3, 40)
    logits[:, ::3] = 1.0  # 14 tied maxima, then 26 tied others
    ids, vals = top_logprobs(logits, 20)
    for row in ids.tolist():
        assert row[:14] == list(range(0, 40, 3))
        assert row[14:] == sorted(row[14:]) and all(t % 3 for t in row[14:])
    assert torch.equal(vals, logits.log_softmax(-1).gather(1, ids))


def test_greedy_into_writes_the_ids_and_the_host_ring_row():
    from mlaserve.layers.sampler import greedy_into

    logits = torch.randn(3, 50)
    out = torch.full((3,), -1, dtype=torch.int64)
    host = torch.full((4, 5), -1, dtype=torch.int64)
    greedy_into(logits, out, host, torch.tensor([2], dtype=torch.int32))
    assert torch.equal(out, logits.argmax(-1))
    assert host[2, :3].tolist() == out.tolist() and (host[2, 3:] == -1).all()
    assert (host[[0, 1, 3]] == -1).all()  # the other ring rows untouched


def test_greedy_tokens_of_verify_shaped_logits():
    from mlaserve.layers.sampler import greedy_tokens

    logits = torch.randn(2, 4, 30)  # [B, N, V]: a verify step's rows
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


def test_race_noise_rows_and_streams():
    """race_noise [S * n, V]: a seeded row's n rows are the next n * V draws of its own generator, the others' one
    draw of len(shared) * n rows from the engine's generator in row order; each generator advances by just that."""
    from mlaserve.layers.sampler import race_noise

    V, n = 16, 2
    own = [torch.Generator().manual_seed(s) for s in (5, 6)]
    eng = torch.Generator().manual_seed(9)
    ps = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=1.0)] * 2
    ps[2] = SamplingParams(temperature=1.0, seed=6)
    e = race_noise(rows(*ps, gens=[own[0], None, own[1], None]), n, V, eng, "cpu")

    ref = [torch.Generator().manual_seed(s) for s in (5, 6, 9)]
    draw = lambda g, r: torch.empty(r, V).exponential_(generator=g)  # noqa: E731
    a, b, shared = draw(ref[0], n), draw(ref[1], n), draw(ref[2], 2 * n)
    assert torch.equal(e, torch.cat([a, shared[:n], b, shared[n:]]))
    for g, r in zip(own + [eng], ref):  # the next draw of each: nothing more was taken
        assert torch.equal(draw(g, 1), draw(r, 1))


def test_which_rows_the_race_kernel_takes():
    """Every sampled row but those with both top-k and top-p (top-k off when 0, -1 or >= V; top-p off at 1.0)."""
    from mlaserve.layers.sampler import _fused

    V = 50
    took = lambda **kw: _fused(SamplingParams(**kw), V)  # noqa: E731
    assert took(top_k=5) and took(top_p=0.9) and took(min_p=0.1) and took(top_k=5, top_p=1.0)
    assert took(top_k=0, top_p=0.9) and took(top_k=-1, top_p=0.9) and took(top_k=V, top_p=0.9)
    assert not took(top_k=5, top_p=0.9) and not took(top_k=1, top_p=0.9) and not took(top_k=V - 1, top_p=0.99)


def test_which_rows_race_over_their_top_k_candidates():
    """The rows the race kernel leaves (top-k and top-p both on) with top-k up to TOPK_CANDIDATES."""
    from mlaserve.layers.sampler import TOPK_CANDIDATES, _candidates

    V = 5000
    took = lambda **kw: _candidates(SamplingParams(**kw), V)  # noqa: E731
    assert took(top_k=1, top_p=0.9) and took(top_k=TOPK_CANDIDATES, top_p=0.99) and took(top_k=50, top_p=0.5)
    assert not took(top_k=TOPK_CANDIDATES + 1, top_p=0.9) and not took(top_k=50) and not took(top_p=0.9)
    assert not took(top_k=0, top_p=0.9) and not took(top_k=-1, top_p=0.9) and not took(top_k=V, top_p=0.9)
    assert not _candidates(SamplingParams(top_k=40, top_p=0.9), 40)


def test_top_k_candidates_race_equals_the_reference():
    """_candidates_into (the race over torch.topk's values) gives the reference's tokens (the sort-based filter over
    the whole row, softmax, argmax(p / E)) from the same logits and noise rows, on fresh random rows: temperatures,
    top-k from 1 to near V, top-p (its mass over the top-k set's), min-p on half; rows not named stay poisoned."""
    from mlaserve.layers.sampler import _candidates_into

    g = torch.Generator().manual_seed(3)
    u = lambda: float(torch.rand(1, generator=g))  # noqa: E731
    for trial in range(60):
        V = int(torch.randint(20, 3000, (1,), generator=g))
        n = 1 + trial % 5
        ps = [
            SamplingParams(
                temperature=0.1 + 1.5 * u(),
                top_k=[1, 2, 7, 40, V - 1][(trial + j) % 5],
                top_p=0.05 + 0.94 * u(),
                min_p=0.3 * u() if trial % 2 else 0.0,
            )
            for j in range(n)
        ]
        logits = torch.randn(n + 2, V, generator=g) * (0.1 + 5 * u())
        noise = torch.empty(n + 1, V).exponential_(generator=g)
        nrow = [(j + 1) % (n + 1) for j in range(n)]  # each row's noise row, not its own index
        tok = torch.full((n + 2,), -1, dtype=torch.int64)
        _candidates_into(tok, logits, rows(*ps), list(range(1, n + 1)), nrow, noise)
        ref = (_filter(logits[1 : n + 1], rows(*ps)).softmax(-1) / noise[nrow]).argmax(-1)
        assert torch.equal(tok[1 : n + 1], ref), (trial, tok.tolist(), ref.tolist())
        assert tok[0] == -1 and tok[-1] == -1
