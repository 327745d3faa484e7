"""The batched logits processors against a per-token Python reference, on random logits: every row's own
parameters, rows without processors untouched, a token in flight (overlapped decode) counted."""

import torch

from mlaserve.layers.logits_process import SamplingRow, process_logits
from mlaserve.layers.sampler import sample, top_logprobs
from mlaserve.types import SamplingParams
from tests.helpers.ref_sampling import ref_process

V = 50


def _rows(gen):
    ps = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(),
        SamplingParams(repetition_penalty=1.4, logit_bias={3: 5.0, 7: -100}),
        SamplingParams(min_tokens=4, stop_token_ids=[1, 2], repetition_penalty=0.8, frequency_penalty=-0.5),
        SamplingParams(allowed_token_ids=[3, 9, 11, 40, 9], logit_bias={9: 2.0, 12: 1.0}, presence_penalty=0.5),
    ]
    rows = []
    for p in ps:
        prompt = torch.randint(0, V, (9,), generator=gen).tolist()
        out = torch.randint(0, V, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist()
        rows.append(SamplingRow(p, None, prompt, out, frozenset(p.stop_token_ids), {}))
    return rows


def test_matches_reference_per_token():
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits, rows = torch.randn(5, V, generator=gen) * 3, _rows(gen)
        got = process_logits(logits, rows)
        for i, r in enumerate(rows):
            want = ref_process(logits[i], r.prompt_ids, r.output_ids, r.params)
            torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
        assert torch.equal(got[1], logits[1])


def test_pending_token_counts():
    gen = torch.Generator().manual_seed(1)
    logits, rows = torch.randn(5, V, generator=gen), _rows(gen)
    pending = torch.randint(0, V, (5,), generator=gen)
    got = process_logits(logits, rows, pending)
    for i, r in enumerate(rows):
        out = r.output_ids + [int(pending[i])]
        torch.testing.assert_close(got[i], ref_process(logits[i], r.prompt_ids, out, r.params), rtol=1e-6, atol=1e-6)


def test_plain_rows_are_not_copied():
    logits = torch.randn(3, V)
    assert process_logits(logits, [SamplingRow(SamplingParams(), None)] * 3) is logits


def test_greedy_with_bias_and_raw_logprobs():
    logits = torch.randn(2, V)
    p = SamplingParams(temperature=0, logit_bias={11: 100})
    tok, lp = sample(
        logits, [SamplingRow(p, None), SamplingRow(SamplingParams(temperature=0), None)], want_logprobs=True
    )
    assert tok.tolist() == [11, int(logits[1].argmax())]
    torch.testing.assert_close(lp[0], logits[0].log_softmax(-1)[11])  # the model's, before the bias


def test_top_logprobs():
    logits = torch.randn(3, V)
    ids, lps = top_logprobs(logits, 5)
    ref = logits.log_softmax(-1).topk(5)
    torch.testing.assert_close(lps, ref.values)
    assert torch.equal(ids, ref.indices)


def test_pending_tokens_of_varying_number():
    """pending [B, M] with V in the unused places (speculation: a verify row's drafts before it and the verify in
    flight's tokens): every real one counts, for the penalties and for min_tokens, their number read on the device."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        logits, rows = torch.randn(5, V, generator=gen), _rows(gen)
        pending = torch.randint(0, V, (5, 5), generator=gen)
        n = torch.randint(0, 6, (5,), generator=gen)
        pending[torch.arange(5)[None, :] >= n[:, None]] = V
        got = process_logits(logits, rows, pending)
        for i, r in enumerate(rows):
            out = r.output_ids + pending[i, : n[i]].tolist()
            want = ref_process(logits[i], r.prompt_ids, out, r.params)
            torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)


def test_allowed_token_ids_keep_only_those():
    """allowed_token_ids: every other token at -inf (whatever its bias), the mask made once per request."""
    logits = torch.randn(2, V)
    rows = [
        SamplingRow(SamplingParams(allowed_token_ids=[4, 30], logit_bias={5: 100.0}), None, [], [], frozenset(), {})
    ]
    rows.append(SamplingRow(SamplingParams(), None, [], [], frozenset(), {}))
    got = process_logits(logits, rows)
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [4, 30] and torch.equal(got[1], logits[1])
    assert torch.equal(got[0, [4, 30]], logits[0, [4, 30]])
    mask = rows[0].cache["allowed_mask"]
    assert mask.nonzero().flatten().tolist() == [4, 30]
    process_logits(logits, rows)
    assert rows[0].cache["allowed_mask"] is mask  # made once per request
    tok, _ = sample(torch.randn(64, V), [rows[0]] * 64, torch.Generator().manual_seed(1))
    assert set(tok.tolist()) <= {4, 30}


def test_bad_words_ban_a_words_last_token_after_its_start():
    """bad_words (their token sequences in the row's cache): a one-token word is always banned; a longer one's last
    token only where the output ends with the tokens before it."""
    logits = torch.randn(3, V)
    seqs = {"bad_words": [(5,), (7, 9), (1, 2, 3)]}
    p = SamplingParams(bad_words=["x"])
    rows = [
        SamplingRow(p, None, [], [4, 7], frozenset(), dict(seqs)),  # ends with 7: 9 banned too
        SamplingRow(p, None, [], [1, 2, 7, 1, 2], frozenset(), dict(seqs)),  # ends with 1, 2: 3 banned
        SamplingRow(p, None, [7], [], frozenset(), dict(seqs)),  # the prompt's 7 does not count
    ]
    got = process_logits(logits, rows)
    banned = [sorted(torch.isinf(r).nonzero().flatten().tolist()) for r in got]
    assert banned == [[5, 9], [3, 5], [5]]
    keep = torch.isfinite(got)
    assert torch.equal(got[keep], logits[keep])


def test_min_tokens_masks_stop_ids_until_reached_counting_tokens_in_flight():
    """min_tokens alone: EOS and stop ids at -inf while the output (with the tokens in flight: one a row, or up to
    M a row padded with V) is shorter; every such row masked, not only the last; an id >= V is ignored."""
    V, eos = 50, 1
    logits = torch.zeros(4, V)
    p = SamplingParams(min_tokens=3, stop_token_ids=[7])
    stops = frozenset({eos, 7, V})  # V: outside this vocabulary
    rows = [SamplingRow(p, None, [9], [5] * n, stops, {}) for n in (2, 3, 1, 0)]
    masked = lambda out: [bool(torch.isinf(out[i, [eos, 7]]).all()) for i in range(4)]  # noqa: E731
    assert masked(process_logits(logits, rows)) == [True, False, True, True]
    assert masked(process_logits(logits, rows, torch.full((4,), 5))) == [False, False, True, True]
    pending = torch.tensor([[5, V], [V, V], [5, V], [5, 5]])  # 1, 0, 1 and 2 tokens in flight
    assert masked(process_logits(logits, rows, pending)) == [False, False, True, True]
    assert masked(process_logits(logits, rows, torch.tensor([[5, 5, 5]] * 4))) == [False, False, False, False]
    biased = SamplingParams(min_tokens=3, stop_token_ids=[7], logit_bias={3: 0.5})  # processed for its bias
    rows = [SamplingRow(biased, None, [9], [5] * n, stops, {}) for n in (2, 3, 1, 0)]
    assert masked(process_logits(logits, rows)) == [True, False, True, True]


def test_repetition_penalty_alone_and_the_prompt_mask_made_once():
    """Rows whose only processor is the repetition penalty (none at 1.0 beside them): the prompt's and output's
    tokens penalised as the per-token reference does; the prompt's mask is made once per request."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=gen) * 3
    rows = [
        SamplingRow(SamplingParams(repetition_penalty=r), None, [3, 4, 40], [4, 9], frozenset(), {}) for r in (1.5, 0.7)
    ]
    got = process_logits(logits, rows)
    for i, r in enumerate(rows):
        want = ref_process(logits[i], r.prompt_ids, r.output_ids, r.params)
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
    mask = rows[0].cache["prompt_mask"]
    assert mask.nonzero().flatten().tolist() == [3, 4, 40]
    process_logits(logits, rows)
    assert rows[0].cache["prompt_mask"] is mask
