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
