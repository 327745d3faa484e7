"""Logprobs under speculative decoding (engine/spec_loop.py): each emitted token's logprob is the model's raw
log-softmax at its position and its top alternatives that position's k most likely tokens, as plain decoding reports
them, whether the token is a verify row's own, an accepted draft, or a prefill's first token; for greedy and sampled
requests, in steps verified on the device (overlapped) and in mixed steps with prefills, beside requests that asked
for none. An oracle draft accepts several tokens a step."""

import pytest

from mlaserve.config import SpecConfig
from mlaserve.types import SamplingParams
from tests.helpers.oracle_draft import install_oracle
from tests.helpers.ref_sampling import model_logits

from .conftest import make_engine
from .test_spec_device_path import MAX, _prompts, draft, plain  # noqa: F401 (fixtures)


def _events(eng, prompts, params):
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    out = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].append(o)
    return [out[r] for r in rids]


def _flat(evs):
    """(tokens, logprobs, top alternatives) of a request's events."""
    toks = [t for e in evs for t in e.new_token_ids]
    lps = [x for e in evs for x in (e.new_logprobs or [])]
    tops = [x for e in evs for x in (e.new_top_logprobs or [])]
    return toks, lps, tops


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_logprobs_equal_plain(tiny_ckpt, draft, plain, k):  # noqa: F811
    prompts = _prompts(8)
    lp = [
        SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, logprobs=n) for n in (3, None, 0, 5, 3, 1, 0, 2)
    ]
    base = _events(make_engine(tiny_ckpt, page_size=4), prompts, lp)
    eng = make_engine(tiny_ckpt, spec=SpecConfig(draft_model=draft, num_steps=k), page_size=4, max_num_seqs=8)
    install_oracle(eng, prompts, plain)
    got = _events(eng, prompts, lp)
    st = eng.stats()
    assert st["spec_accepted_tokens"] > st["spec_steps"] // 2 and st["overlapped_steps"] > 0, st
    for sp, a, b in zip(lp, base, got):
        (ta, la, pa), (tb, lb, pb) = _flat(a), _flat(b)
        assert ta == tb
        if sp.logprobs is None:
            assert not lb and not pb and b[-1].cumulative_logprob is None
            continue
        assert lb == pytest.approx(la, abs=1e-4) and len(pb) == len(pa) == MAX
        for x, y in zip(pa, pb):
            assert set(x) == set(y) and len(y) == sp.logprobs
            assert [y[t] for t in x] == pytest.approx(list(x.values()), abs=1e-4)
        assert b[-1].cumulative_logprob == pytest.approx(sum(lb), abs=1e-5)


def test_sampled_logprobs_equal_a_reference_log_softmax(tiny_ckpt, draft):  # noqa: F811
    """Sampled requests (accepted drafts and the rule's own draws) report the raw log-softmax of the tokens they
    emit, and its 4 most likely tokens, at every position; the first token comes from a mixed step's prefill."""
    prompts = _prompts(4, seed=3)
    sp = [
        SamplingParams(temperature=t, seed=40 + i, max_tokens=MAX, ignore_eos=True, logprobs=4)
        for i, t in enumerate((0.3, 0.6, 1.0, 1.5))
    ]
    eng = make_engine(tiny_ckpt, spec=SpecConfig(draft_model=draft, num_steps=2), page_size=4, max_num_seqs=8)
    greedy = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    cont = [_flat(e)[0] for e in _events(make_engine(tiny_ckpt, page_size=4), prompts, [greedy] * 4)]
    install_oracle(eng, prompts, cont)  # the greedy continuation: often the likeliest token, so often accepted
    got = _events(eng, prompts, sp)
    assert eng.stats()["spec_accepted_tokens"] > 0
    for prompt, evs in zip(prompts, got):
        toks, lps, tops = _flat(evs)
        assert len(toks) == len(lps) == len(tops) == MAX
        ref = model_logits(eng, prompt + toks[:-1])[len(prompt) - 1 :].log_softmax(-1)  # [MAX, V]
        for i, t in enumerate(toks):
            assert lps[i] == pytest.approx(ref[i, t].item(), abs=1e-4), i
            want = ref[i].topk(4)
            assert set(tops[i]) == set(want.indices.tolist()), i
            assert [tops[i][j] for j in want.indices.tolist()] == pytest.approx(want.values.tolist(), abs=1e-4)
