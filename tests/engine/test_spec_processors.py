"""Logits processors under speculative decoding (engine/spec_loop.py, SpecLoop._processed): repetition, frequency and
presence penalties, logit_bias, allowed_token_ids, min_tokens and bad_words change the verify rows' logits as plain
decoding's, row i of a request counting as generated its first i drafts and, in an overlapped step, the tokens of
the verify in flight. Greedy outputs (and sampled ones at top_k = 1) must equal plain decoding's with the same
processors, token for token, with a random draft and with an oracle draft that proposes those very outputs (so most
drafts are accepted and every verify row past the first depends on the drafts before it), overlapped and not."""

import pytest

from mlaserve.config import SpecConfig
from mlaserve.types import SamplingParams
from tests.helpers.oracle_draft import install_oracle

from .conftest import make_engine, run_requests
from .test_spec_device_path import MAX, _prompts, draft  # noqa: F401 (fixtures)


def _params():
    g = dict(max_tokens=MAX, ignore_eos=True)
    return [
        SamplingParams(temperature=0, repetition_penalty=1.6, **g),
        SamplingParams(temperature=0, frequency_penalty=0.9, presence_penalty=0.6, **g),
        SamplingParams(temperature=0, logit_bias={7: 8.0, 11: -100.0}, **g),
        # stop token 7, pushed up by logit_bias, masked by min_tokens for the first 12 tokens: it ends the 13th
        SamplingParams(temperature=0, min_tokens=12, stop_token_ids=[7], logit_bias={7: 30.0}, max_tokens=MAX),
        SamplingParams(temperature=0, **g),  # no processor, beside the others
        SamplingParams(temperature=0.8, top_k=1, repetition_penalty=1.4, presence_penalty=0.3, **g),
        SamplingParams(temperature=0, allowed_token_ids=[7, 11, 20, 33, 50], **g),
    ]


@pytest.fixture(scope="module")
def plain_processed(tiny_ckpt):
    prompts, params = _prompts(7, seed=5), _params()
    out = run_requests(make_engine(tiny_ckpt, page_size=4), prompts, params)
    bare = [SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)] * len(prompts)
    unprocessed = run_requests(make_engine(tiny_ckpt, page_size=4), prompts, bare)
    changed = [a != b for a, b in zip(out, unprocessed)]
    assert changed == [True, True, True, True, False, True, True], changed  # the processors change the tokens
    assert len(out[3]) == 13 and out[3][-1] == 7, out[3]
    assert set(out[6]) <= {7, 11, 20, 33, 50}, out[6]
    return out


@pytest.mark.parametrize(
    "k,oracle,overlap", [(1, False, True), (3, False, True), (1, True, True), (3, True, True), (2, True, False)]
)
def test_processors_equal_plain(tiny_ckpt, draft, plain_processed, k, oracle, overlap):  # noqa: F811
    """Overlapped steps count the tokens of the verify in flight on the device (the host has not read them)."""
    prompts = _prompts(7, seed=5)
    spec = SpecConfig(draft_model=draft, num_steps=k)
    eng = make_engine(tiny_ckpt, spec=spec, page_size=4, max_num_seqs=8, disable_overlap_schedule=not overlap)
    if oracle:
        install_oracle(eng, prompts, plain_processed)
    assert run_requests(eng, prompts, _params()) == plain_processed
    st = eng.stats()
    assert st["spec_device_steps"] > 0 and (st["overlapped_steps"] > 0) == overlap, st
    if oracle:
        assert st["spec_accepted_tokens"] > st["spec_steps"] // 2, st


@pytest.mark.parametrize("k,oracle", [(1, False), (3, True), (2, True)])
def test_bad_words_equal_plain(tiny_ckpt, draft, k, oracle):  # noqa: F811
    """bad_words under speculation: verify row i matches the words' starts against the output and the request's
    first i drafts, on the host (such steps are not overlapped); greedy outputs equal plain decoding's with the same
    bans, beside a request without them (which overlaps once alone)."""
    prompts = _prompts(4, seed=9)
    g = dict(temperature=0, max_tokens=MAX, ignore_eos=True)
    eng = make_engine(tiny_ckpt, page_size=4)
    free = run_requests(eng, prompts, [SamplingParams(**g)] * 4)
    tok = eng.tokenizer
    params = [SamplingParams(**g, bad_words=[tok.decode(o[2:4]), tok.decode(o[6:7])]) for o in free[:3]]
    # bans beside min_tokens (stop token 7, pushed up, masked for 12 tokens: it ends the 13th) and a penalty: a
    # row's drafts count once, in its output_ids, or 7 would end the output early
    extra = dict(min_tokens=12, stop_token_ids=[7], logit_bias={7: 30.0}, frequency_penalty=0.5, ignore_eos=False)
    params[1] = SamplingParams(**{**params[1].__dict__, **extra})
    params.append(SamplingParams(**{**g, "max_tokens": 3 * MAX}))
    plain = run_requests(make_engine(tiny_ckpt, page_size=4), prompts, params)
    assert sum(a != b for a, b in zip(plain[:3], free)) >= 2  # the bans change the outputs
    assert len(plain[1]) == 13 and plain[1][-1] == 7, plain[1]
    spec = SpecConfig(draft_model=draft, num_steps=k)
    eng = make_engine(tiny_ckpt, spec=spec, page_size=4, max_num_seqs=8)
    if oracle:
        install_oracle(eng, prompts, plain)
    assert run_requests(eng, prompts, params) == plain
    st = eng.stats()
    assert st["spec_device_steps"] > 0 and st["overlapped_steps"] > 0, st
    if oracle:
        assert st["spec_accepted_tokens"] > st["spec_steps"] // 2, st


@pytest.mark.parametrize("algorithm", ["EAGLE3", "NGRAM"])
def test_prompt_logprobs_equal_plain(tiny_ckpt, draft, algorithm):  # noqa: F811
    """prompt_logprobs under speculation: the prefill computes every prompt position's logits, as plain decoding's
    (with long prompts split in chunks beside verify steps): the same prompt logprobs and the same outputs."""
    prompts = [p * 8 for p in _prompts(3, seed=11)]  # past one chunk of 64 tokens
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=k) for k in (0, 2, 5)]
    params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))  # decoding while they prefill
    prompts.append(_prompts(1, seed=12)[0])

    def run(eng):
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        toks, first = {r: [] for r in rids}, {}
        while eng.has_unfinished():
            for o in eng.step():
                toks[o.request_id] += o.new_token_ids
                first.setdefault(o.request_id, o.prompt_logprobs)
        return [toks[r] for r in rids], [first[r] for r in rids]

    kw = dict(page_size=4, max_num_seqs=8, max_num_batched_tokens=64, chunked_prefill_size=64)
    want = run(make_engine(tiny_ckpt, **kw))
    assert all(len(lp) == len(p) for lp, p in zip(want[1][:3], prompts)) and want[1][3] is None
    if algorithm == "EAGLE3":
        spec = SpecConfig(draft_model=draft, num_steps=2)
    else:
        spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=2, prompt_lookup_min=1, prompt_lookup_max=3))
    eng = make_engine(tiny_ckpt, spec=spec, **kw)
    got = run(eng)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):  # the same logits: equal to float32's last bits or within rounding
        assert (a is None) == (b is None)
        for x, y in zip(a or [], b or []):
            assert (x is None and y is None) or (x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x))
    assert eng.stats()["spec_steps"] > 0
