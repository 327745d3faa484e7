"""NGRAM speculative decoding (prompt lookup, spec/ngram.py): the lookup's rule, greedy outputs equal to plain
decoding's with acceptance where the output copies its context, and its config, flags and errors."""

import random

import pytest

from mlaserve.args import engine_kwargs_from_args
from mlaserve.cli import build_parser
from mlaserve.config import EngineConfig, SpecConfig
from mlaserve.engine.engine import LLMEngine
from mlaserve.spec.ngram import NgramIndex
from mlaserve.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def index(tokens, lo, hi):
    idx = NgramIndex(lo, hi)
    idx.extend(tokens[:3])
    idx.extend(tokens[3:])  # in two parts: the same as one
    return idx


def test_lookup_takes_the_longest_suffix_then_its_latest_occurrence():
    # suffix [7, 8]: at 0 followed by 1, at 4 followed by 2; suffix [6, 7, 8]: at 3 followed by 9
    toks = [7, 8, 1, 6, 7, 8, 9, 5, 7, 8, 2, 4, 6, 7, 8]
    assert index(toks, 1, 3).lookup(3) == [9, 5, 7]
    assert index(toks, 1, 2).lookup(3) == [2, 4, 6]  # the latest [7, 8] that has a token after it
    assert index(toks, 4, 5).lookup(2) is None  # [4, 6, 7, 8] occurs once: its own suffix is no match
    assert index([3, 1, 2, 3], 1, 2).lookup(4) == [1, 2, 3, 3]  # a run to the end, padded with its last token
    assert index([5], 1, 1).lookup(2) is None and NgramIndex(1, 3).lookup(1) is None


def test_lookup_equals_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(300):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        hi, k = lo + rng.randrange(3), rng.randrange(1, 5)
        want = None
        for n in range(min(hi, len(toks)), lo - 1, -1):
            ends = [j for j in range(n, len(toks)) if toks[j - n : j] == toks[len(toks) - n :]]
            if ends:
                run = toks[ends[-1] : ends[-1] + k]
                want = run + [run[-1]] * (k - len(run))
                break
        assert index(toks, lo, hi).lookup(k) == want, (toks, lo, hi, k)


def run(engine, prompts, params=GREEDY):
    return run_counted(engine, prompts, [params] * len(prompts))[0]


def run_counted(engine, prompts, params):
    """-> (each request's tokens, its acceptance per draft position from its last event's usage)."""
    rids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    out, last = {r: [] for r in rids}, {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            last[o.request_id] = o
    return [out[r] for r in rids], [list(last[r].usage.spec_accepted_per_position) for r in rids]


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_ckpt):
    """Random prompts, then the same prompts followed by their own greedy continuation (a context to copy
    from), and plain greedy outputs of both (the random target's outputs also fall into loops)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(5, 60))] for _ in range(5)]
    plain = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"))
    first = run(plain, prompts)
    prompts += [p + o for p, o in zip(prompts, first)]
    return prompts, first + run(plain, prompts[5:])


def expected_per_position(prompt, out, k, lo, hi, pred=None):
    """The chain rule over the plain output: each step drafts by the lookup over prompt + out[:n] (the prompt's
    last hi - 1 tokens + pred first), accepts the drafts equal to out[n:], and emits 1 + accepted tokens, cut at
    max_tokens."""
    counts, n = [0] * k, 1  # the prefill emitted output 0
    first = index(prompt[max(0, len(prompt) - hi + 1) :] + pred, lo, hi) if pred else None
    while n < len(out):
        d = index(prompt + out[:n], lo, hi).lookup(k, first) or [out[n - 1]] * k
        a = 0
        while a < k and n + a < len(out) and d[a] == out[n + a]:
            a += 1
        emitted = min(1 + a, len(out) - n)
        for i in range(emitted - 1):
            counts[i] += 1
        n += emitted
    return counts


@pytest.mark.parametrize("k,lo,hi", [(1, 1, 3), (3, 2, 4), (2, 5, 5)])
def test_ngram_greedy_outputs_equal_plain(tiny_ckpt, prompts_and_plain, k, lo, hi):
    """Outputs equal plain decoding's, and each request's acceptance per position is exactly what the lookup rule
    gives over its plain output."""
    prompts, plain = prompts_and_plain
    spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=k, prompt_lookup_min=lo, prompt_lookup_max=hi))
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=spec)
    got, per_position = run_counted(eng, prompts, [GREEDY] * len(prompts))
    assert got == plain
    want = [expected_per_position(p, o, k, lo, hi) for p, o in zip(prompts, plain)]
    assert per_position == want
    assert sum(c[0] for c in want) > 10  # the loops and the copies are found
    assert 0 < eng.proposer.matched_tokens < eng.proposer.proposed_tokens == k * eng.stats()["spec_steps"]


def test_lookup_takes_the_prediction_first_at_each_n():
    ctx, pred = index([1, 2, 3, 9, 1, 2], 1, 2), index([5, 1, 2, 4, 4], 1, 2)
    assert ctx.lookup(2) == [3, 9] and ctx.lookup(2, pred) == [4, 4]
    assert index([7, 2], 1, 2).lookup(2, pred) == [4, 4]  # [7, 2] is in neither: [2] in the prediction
    assert index([1, 2, 3, 9, 1, 2], 2, 2).lookup(2, index([5, 6], 2, 2)) == [3, 9]  # no match there: the context's


def test_proposer_finds_n_grams_across_the_prompt_and_prediction_join():
    """The prediction is indexed after the prompt's last hi - 1 tokens (a prompt shorter than that whole), so the
    first output token after the prompt already finds its continuation; without a match, the last token repeated."""
    from types import SimpleNamespace

    from mlaserve.spec.ngram import NgramProposer
    from mlaserve.types import Request

    prop = NgramProposer(SimpleNamespace(num_steps=2, prompt_lookup_min=3, prompt_lookup_max=5))
    req = Request([4, 5, 6], GREEDY, prediction_token_ids=[7, 8, 9], output_token_ids=[7])
    assert prop.tokens(req) == [8, 9]
    req.output_token_ids += [8, 1]
    assert prop.tokens(req) == [1, 1] and (prop.proposed_tokens, prop.matched_tokens) == (4, 2)
    idx = prop.index[req.request_id][1]
    req.output_token_ids += [4, 5, 6]
    assert prop.tokens(req) == [7, 8] and (prop.proposed_tokens, prop.matched_tokens) == (6, 4)
    assert prop.index[req.request_id][1] is idx and idx.tokens == [4, 5, 6, 7, 8, 1, 4, 5, 6]  # extended, not rebuilt
    four = NgramProposer(SimpleNamespace(num_steps=2, prompt_lookup_min=4, prompt_lookup_max=4))
    for prompt in ([4, 5, 6], list(range(20, 30)) + [4, 5, 6]):  # the join's 4-grams need the prompt's last 3
        req = Request(prompt, GREEDY, prediction_token_ids=[7, 8, 9], output_token_ids=[7])
        assert four.tokens(req) == [8, 9], prompt


def test_proposer_forgets_finished_requests():
    from types import SimpleNamespace

    from mlaserve.spec.ngram import NgramProposer
    from mlaserve.types import Request, RequestStatus

    prop = NgramProposer(SimpleNamespace(num_steps=1, prompt_lookup_min=1, prompt_lookup_max=2))
    reqs = [Request([1, 2, 1], GREEDY, output_token_ids=[2]) for _ in range(70)]
    for i, r in enumerate(reqs):
        assert prop.tokens(r) == [1]
        if i % 2:
            r.status = RequestStatus.FINISHED
    assert len(prop.index) == 70 - 32  # at the 66th, 32 of the 65 held had finished
    assert all(not r.finished for r, *_ in list(prop.index.values())[:-5])


@pytest.mark.parametrize("k", [1, 3])
def test_prediction_drafts_the_predicted_output(tiny_ckpt, prompts_and_plain, k):
    """OpenAI's Predicted Outputs on an NGRAM engine: each request predicting its own plain output (as token ids,
    one with an edit in the middle) keeps greedy equal to plain, its acceptance exactly the rule's with the
    prediction looked up first, and accepts more than without a prediction; a plain engine ignores it."""
    prompts, plain = prompts_and_plain
    prompts, plain = prompts[:5], plain[:5]
    preds = [o[:20] + [7, 7, 7] + o[20:] if i == 2 else list(o) for i, o in enumerate(plain)]
    spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=k, prompt_lookup_min=1, prompt_lookup_max=3))
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=spec)
    outs, got = run_counted(eng, prompts, [SamplingParams(**{**GREEDY.__dict__, "prediction": q}) for q in preds])
    assert outs == plain
    assert got == [expected_per_position(p, o, k, 1, 3, q) for p, o, q in zip(prompts, plain, preds)]
    without = [expected_per_position(p, o, k, 1, 3) for p, o in zip(prompts, plain)]
    assert sum(map(sum, got)) > 2 * sum(map(sum, without))
    assert sum(c[0] for c in got) >= 0.8 * sum(len(o) // (k + 1) for o in plain)
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"))
    assert run(eng, prompts[:1], SamplingParams(**{**GREEDY.__dict__, "prediction": preds[0]})) == plain[:1]


def test_prediction_errors(tiny_ckpt):
    for bad in ("", [], [1, -2], [1.5], {"a": 1}):
        with pytest.raises(ValueError, match="prediction: must be non-empty text or a non-empty list of token ids"):
            SamplingParams(prediction=bad)
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=SpecConfig.from_dict(dict(algorithm="NGRAM")))
    with pytest.raises(ValueError, match=r"prediction: token id 512 is outside the vocabulary \[0, 512\)"):
        eng.add_request([1, 2], SamplingParams(prediction=[3, 512]))


def test_ngram_sampled_requests_run(tiny_ckpt, prompts_and_plain):
    """Sampled requests verify their n-gram drafts by the speculative-sampling rule; a seeded one repeats."""
    prompts = prompts_and_plain[0][5:7]
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=SpecConfig.from_dict(dict(algorithm="NGRAM")))
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=3)
    a, b = run(eng, prompts, p), run(eng, prompts, p)
    assert a == b and all(len(t) == 16 for t in a)


def test_ngram_config_defaults_and_vllm_keys():
    assert SpecConfig.from_dict(dict(algorithm="NGRAM")).prompt_lookup_min == 5
    d = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert d.is_ngram and (d.prompt_lookup_min, d.prompt_lookup_max, d.num_draft_tokens) == (4, 4, 4)
    d = SpecConfig.from_dict({"method": "[ngram]", "prompt_lookup_min": 2})
    assert (d.prompt_lookup_min, d.prompt_lookup_max, d.num_steps) == (2, 2, 1)
    from mlaserve.server.api import speculative_card  # here: tests/gpu imports this module without the server

    card = speculative_card(SpecConfig.from_dict(dict(algorithm="ngram", prompt_lookup_min=1, prompt_lookup_max=3)))
    assert card["algorithm"] == "NGRAM" and not card["benchmark_only"] and card["prompt_lookup_max"] == 3


@pytest.mark.parametrize(
    "d,msg",
    [
        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min: at most prompt_lookup_max"),
        (dict(prompt_lookup_min=0), "prompt_lookup_min: an integer in"),
        (dict(prompt_lookup_min=1, prompt_lookup_max=65), "prompt_lookup_max: an integer in"),
        (dict(prompt_lookup_min=1, prompt_lookup_max=2.5), "prompt_lookup_max: an integer in"),
        (dict(draft_model="/x"), "draft_model: NGRAM drafts from the context"),
        (dict(replay_path="/x"), "replay_path: NGRAM"),
        (dict(simulate_acceptance=0.5), "simulate_acceptance: NGRAM"),
        (dict(algorithm="EAGLE3", draft_model=None, prompt_lookup_min=2), "prompt_lookup_min/max: only the NGRAM"),
        (dict(algorithm=None, method="medusa"), "method: eagle3 .* or ngram"),
    ],
)
def test_ngram_config_errors(d, msg):
    d = {"algorithm": "NGRAM", **d}
    if d["algorithm"] is None:
        del d["algorithm"]
    with pytest.raises(ValueError, match=f"speculative_config.{msg}"):
        SpecConfig.from_dict(d)


def test_ngram_cli_flags():
    argv = ["generate", "--prompt", "x", "--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3"]
    argv += ["--speculative-ngram-min-match-window-size", "2", "--speculative-ngram-max-match-window-size", "6"]
    spec = SpecConfig.from_dict(engine_kwargs_from_args(build_parser(argv).parse_args(argv))["speculative_config"])
    assert spec.is_ngram and (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_draft_tokens) == (2, 6, 4)
    argv = ["generate", "--prompt", "x", "--speculative-ngram-max-match-window-size", "6"]
    with pytest.raises(ValueError, match="for --speculative-algorithm NGRAM"):
        engine_kwargs_from_args(build_parser(argv).parse_args(argv))


def test_ngram_server_takes_openai_prediction(tiny_ckpt):
    """Through the server: a chat request predicting its reply's text (OpenAI's prediction field, both content
    forms) gets the same reply with more accepted prediction tokens in its usage; a malformed prediction is a 400
    naming the field; the server ends idle with no page leaked."""
    import httpx

    from ..server.conftest import assert_idle_no_leak, start_server

    spec = dict(algorithm="NGRAM", num_steps=3, prompt_lookup_min=1, prompt_lookup_max=3)
    run_ = start_server(tiny_ckpt, speculative_config=spec)
    try:
        url = f"{run_.url}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 40, "temperature": 0}
        body |= {"ignore_eos": True, "return_token_ids": True}
        first = httpx.post(url, json=body, timeout=60).json()
        text = first["choices"][0]["message"]["content"]
        parts = [{"type": "text", "text": text[:7]}, {"type": "text", "text": text[7:]}]
        for content in (text, parts):
            r = httpx.post(url, json={**body, "prediction": {"type": "content", "content": content}}, timeout=60)
            assert r.status_code == 200, r.text
            again = r.json()
            assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
            got, base = (x["usage"]["completion_tokens_details"] for x in (again, first))
            assert got["accepted_prediction_tokens"] > base["accepted_prediction_tokens"] + 10, (got, base)
        for bad in ({"type": "content"}, {"type": "text", "content": "x"}, "x", {"type": "content", "content": [1]}):
            r = httpx.post(url, json={**body, "prediction": bad}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", (bad, r.text)
        assert_idle_no_leak(run_)
    finally:
        assert run_.stop() == 0
