"""The chain-acceptance rules of spec/verify.py with exact expected counts: greedy (a mismatch ends the chain even when
later drafts match, all accepted, the bonus token) and sampled (temperature > 0) against the target distribution."""

import torch

from mlaserve.layers.sampler import SamplingRow
from mlaserve.spec.verify import count_accepted, verify_greedy, verify_rows
from mlaserve.types import SamplingParams


def greedy_logits(paths: list[list[int]], V: int = 16) -> torch.Tensor:
    """[B, N, V] logits whose arg-max at row i of request b is paths[b][i]."""
    out = torch.full((len(paths), len(paths[0]), V), -5.0)
    for b, p in enumerate(paths):
        for i, t in enumerate(p):
            out[b, i, t] = 5.0
    return out


def per_position(accepted: list[int], k: int) -> list[int]:
    counts: list[int] = []
    for a in accepted:
        count_accepted(counts, a, k)
    return counts


def test_greedy_mismatch_then_match_counts_only_the_prefix():
    # target's greedy path per request: rows 0..3 (row 3 is the bonus row)
    paths = [[4, 7, 1, 9], [4, 7, 1, 9], [4, 7, 1, 9], [4, 7, 1, 9]]
    drafts = torch.tensor([[5, 7, 1], [4, 8, 1], [4, 7, 2], [5, 8, 2]])  # miss at 1, at 2, at 3; all missed
    y, acc = verify_greedy(greedy_logits(paths), drafts)
    assert acc.tolist() == [0, 1, 2, 0]  # the matches after a mismatch do not count
    emitted = [y[b][: acc[b] + 1].tolist() for b in range(4)]
    assert emitted == [[4], [4, 7], [4, 7, 1], [4]]  # 1 + accepted: the target's own token at the mismatch
    assert per_position(acc.tolist(), 3) == [2, 1, 0]


def test_greedy_all_accepted_emits_the_bonus_token():
    paths = [[3, 3, 11, 2], [6, 0, 0, 13]]
    drafts = torch.tensor([[3, 3, 11], [6, 0, 0]])
    y, acc = verify_greedy(greedy_logits(paths), drafts)
    assert acc.tolist() == [3, 3]
    emitted = [y[b][: acc[b] + 1].tolist() for b in range(2)]
    assert emitted == [[3, 3, 11, 2], [6, 0, 0, 13]]  # K drafts + the bonus row's arg-max, which no draft proposed
    assert per_position(acc.tolist(), 3) == [2, 2, 2]


def test_greedy_ties_break_to_the_lowest_id_like_plain_decode():
    logits = torch.zeros(1, 2, 8)
    logits[0, 0, 2] = logits[0, 0, 5] = 1.0  # a tie: plain greedy takes 2
    y, acc = verify_greedy(logits, torch.tensor([[5]]))
    assert acc.tolist() == [0] and y[0, 0].item() == 2


def test_count_accepted_grows_to_k_and_counts_the_first_positions():
    counts = []
    count_accepted(counts, 0, 3)
    assert counts == [0, 0, 0]
    count_accepted(counts, 2, 3)
    count_accepted(counts, 3, 3)
    assert counts == [2, 2, 1]


def verify_sampled(logits: torch.Tensor, drafts: list[int], row: SamplingRow, g: torch.Generator) -> list[int]:
    """One request's emitted tokens (verify_rows on a batch of one)."""
    y, acc = verify_rows(logits[None], torch.tensor([drafts]), [row], g)
    return y[0, : int(acc[0]) + 1].tolist()


def _sampled(probs: list[list[float]], drafts: list[int], n: int, seed: int = 0) -> list[list[int]]:
    """n requests with the same target and drafts, verified in one batch (the engine's generator for all)."""
    lg = torch.log(torch.tensor(probs).clamp_min(1e-30))
    g = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(SamplingParams(temperature=1.0), None)] * n
    y, acc = verify_rows(lg.expand(n, *lg.shape), torch.tensor([drafts] * n), rows, g)
    return [r[: a + 1] for r, a in zip(y.tolist(), acc.tolist())]


def test_sampled_exact_counts_with_certain_and_impossible_drafts():
    """p(draft) = 1 is always accepted, p(draft) = 0 never; the rejection samples from p without the draft."""
    probs = [[0, 1, 0, 0], [0, 0, 1, 0], [0.5, 0.5, 0, 0], [0, 0, 0, 1]]  # rows 0-2 verify drafts 1, 2, 3
    outs = _sampled(probs, [1, 2, 3], 400)
    acc = [len(o) - 1 for o in outs]
    assert per_position(acc, 3) == [400, 400, 0]
    assert all(o[:2] == [1, 2] and o[2] in (0, 1) for o in outs)  # never the rejected draft 3
    outs = _sampled([[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0]], [1, 2, 3], 50)
    assert per_position([len(o) - 1 for o in outs], 3) == [50, 50, 50]
    assert all(o == [1, 2, 3, 0] for o in outs)  # all accepted: the bonus token comes from the last row


def test_sampled_matches_the_target_distribution():
    """Every emitted position is distributed as the target's p: the first (accept d w.p. p(d), else the residual),
    the second given the first accepted, and the bonus token after all accepted."""
    p0, p1, p2 = [0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]
    outs = _sampled([p0, p1, p2], [1, 1], 12000, seed=1)
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=3).float() / len(outs)
    assert torch.allclose(first, torch.tensor(p0), atol=0.02), first
    second = [o[1] for o in outs if o[0] == 1]
    freq = torch.bincount(torch.tensor(second), minlength=3).float() / len(second)
    assert torch.allclose(freq, torch.tensor(p1), atol=0.03), freq
    bonus = [o[2] for o in outs if len(o) == 3]
    freq = torch.bincount(torch.tensor(bonus), minlength=3).float() / len(bonus)
    assert torch.allclose(freq, torch.tensor(p2), atol=0.04), freq
    acc = per_position([len(o) - 1 for o in outs], 2)  # P(accept 1) = p0(1); P(accept both) = p0(1) * p1(1)
    assert abs(acc[0] / len(outs) - 0.3) < 0.015 and abs(acc[1] / len(outs) - 0.18) < 0.015, acc


def test_count_accepted_pads_a_short_list_to_k():
    counts = [5]
    count_accepted(counts, 2, 3)
    assert counts == [6, 1, 0]


def _seeded_runs(row_seed, engine_seed, global_seed, n=200):
    """verify_sampled n times on a fixed 8-token target with 3 drafts that are often rejected (so the residual and
    bonus draws run too), the global RNG reseeded first: a draw taken from it would show as a different output."""
    torch.manual_seed(global_seed)
    lg = torch.log(torch.tensor([[0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05]] * 4))
    row_gen = None if row_seed is None else torch.Generator().manual_seed(row_seed)
    row = SamplingRow(SamplingParams(temperature=1.0), row_gen)
    g = torch.Generator().manual_seed(engine_seed)
    return [verify_sampled(lg, [0, 1, 0], row, g) for _ in range(n)]


def test_sampled_draws_only_from_the_request_generator():
    """A seeded request draws every random number (accept, residual, bonus) from its own generator, the others
    from the engine's: the global RNG never, so the same seeds give the same tokens."""
    a = _seeded_runs(7, 100, global_seed=1)
    assert a == _seeded_runs(7, 200, global_seed=2)  # the request's generator: the engine's does not matter
    assert a == _seeded_runs(None, 7, global_seed=3)  # the same stream when it is the engine's
    assert a != _seeded_runs(8, 7, global_seed=1)
    lens = {len(o) for o in a}
    assert lens == {1, 2, 3, 4}, lens  # rejections at every position and all accepted (the bonus draw)


def test_sampled_applies_temperature_and_top_k():
    """The rule runs on the request's filtered distribution: with top_k = 1 it accepts exactly the drafts equal to
    each row's arg-max and emits the arg-max at the first rejection (greedy's tokens); temperature sharpens p."""
    torch.manual_seed(0)
    lg = torch.randn(4, 8)
    y = lg.argmax(-1).tolist()
    row = SamplingRow(SamplingParams(temperature=1.0, top_k=1), None)
    g = torch.Generator().manual_seed(0)
    for drafts in ([y[0], y[1], y[2]], [y[0], (y[1] + 1) % 8, y[2]], [(y[0] + 1) % 8, y[1], y[2]]):
        a = 0
        while a < 3 and drafts[a] == y[a]:
            a += 1
        assert verify_sampled(lg, drafts, row, g) == y[: a + 1]
    # temperature 0.25 on p = (0.6, 0.4): p' = (0.6^4, 0.4^4) / sum = (0.835, 0.165): draft 1 accepted w.p. 0.165
    cold = SamplingRow(SamplingParams(temperature=0.25), None)
    lg = torch.log(torch.tensor([[0.6, 0.4], [0.5, 0.5]]))
    outs = [verify_sampled(lg, [1], cold, g) for _ in range(4000)]
    rate = sum(len(o) == 2 for o in outs) / len(outs)
    assert abs(rate - 0.165) < 0.02, rate  # at temperature 1 it would be 0.4


def test_rows_of_a_batch_are_independent():
    """In one batch, greedy rows get verify_greedy's tokens and counts, and a seeded sampled row the tokens it gets
    alone: its draws come from its own generator only, whatever the unseeded and other seeded rows beside it draw."""
    torch.manual_seed(0)
    lg = torch.randn(5, 3, 12) * 2
    drafts = lg[:, :2].argmax(-1)
    drafts[1, 0] = (drafts[1, 0] + 1) % 12  # a rejection at the first position of row 1

    def seeded(s):
        return SamplingRow(SamplingParams(temperature=1.0, seed=s), torch.Generator().manual_seed(s))

    greedy = SamplingRow(SamplingParams(temperature=0), None)
    rows = [greedy, seeded(3), SamplingRow(SamplingParams(temperature=0.8), None), greedy, seeded(4)]
    y, acc = verify_rows(lg, drafts, rows, torch.Generator().manual_seed(9))
    gy, gacc = verify_greedy(lg, drafts)
    for b in (0, 3):
        assert y[b].tolist() == gy[b].tolist() and acc[b] == gacc[b]
    for b, s in ((1, 3), (4, 4)):
        alone = verify_sampled(lg[b], drafts[b].tolist(), seeded(s), torch.Generator().manual_seed(0))
        assert y[b, : int(acc[b]) + 1].tolist() == alone
    rejected = [(b, int(a)) for b, a in enumerate(acc.tolist()) if a < 2 and b in (1, 2, 4)]
    assert all(y[b, a] != drafts[b, a] for b, a in rejected)  # a rejected draft is never emitted in its place
