"""The sampling parameters through the official openai client: n with seeded distinct choices on shared KV pages,
top_logprobs equal to the model's log-softmax, penalties and logit_bias as a reference sampler computes them, echo
with prompt logprobs, best_of; and the endpoints /version, /tokenize, /detokenize, /v1/models/{id}."""

import json

import httpx
import openai
import pytest

from mlaserve import SamplingParams
from tests.helpers.ref_sampling import model_logits, ref_greedy, ref_greedy_banned

from .conftest import assert_idle_no_leak, greedy_ids

PROMPT = list(range(100, 140))  # 40 tokens: 2 full pages of 16 are shared by the choices


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_n_seeded_distinct_on_shared_pages(server, client):
    eng, peak = server.engine, [0]
    step = eng.step

    def counted():
        outs = step()
        peak[0] = max(peak[0], eng.pool.num_used)
        return outs

    eng.step = counted
    try:
        kw = dict(model="tiny", prompt=PROMPT, n=3, max_tokens=4, temperature=1.0, seed=7)
        r = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    finally:
        del eng.step
    ids = [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2] and len({tuple(x) for x in ids}) == 3
    assert r.usage.prompt_tokens == 40 and r.usage.completion_tokens == 12
    assert peak[0] == 2 + 3  # the 2 full prompt pages once, one page each for the rest (3 x 3 unshared)
    again = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.model_extra["token_ids"] for c in sorted(again.choices, key=lambda c: c.index)] == ids
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3, temperature=1.0, seed=1
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert_idle_no_leak(server)


def test_top_logprobs_equal_model_log_softmax(server, offline, client):
    r = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=5,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    ref = model_logits(offline.engine, PROMPT + ids).log_softmax(-1)[len(PROMPT) - 1 : -1]
    for j, top in enumerate(c.logprobs.top_logprobs):
        want = ref[j].topk(5)  # greedy: the sampled token is the first of them
        assert list(top) == [f"token_id:{t}" for t in want.indices.tolist()]
        assert list(top.values()) == pytest.approx(want.values.tolist(), abs=1e-4)
        assert c.logprobs.token_logprobs[j] == pytest.approx(ref[j, ids[j]].item(), abs=1e-4)
    msgs = [{"role": "user", "content": "hello"}]
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}).json()["tokens"]
    chat = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"return_tokens_as_token_ids": True},
    )
    out = greedy_ids(offline, prompt, 3)
    ref = model_logits(offline.engine, prompt + out).log_softmax(-1)[len(prompt) - 1 : -1]
    for j, e in enumerate(chat.choices[0].logprobs.content):
        want = ref[j].topk(5)
        assert [t.token for t in e.top_logprobs] == [f"token_id:{t}" for t in want.indices.tolist()]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(want.values.tolist(), abs=1e-4)


def test_penalties_and_logit_bias_as_reference(server, offline, client):
    plain = greedy_ids(offline, PROMPT, 8, ignore_eos=True)
    bias = {str(plain[1]): -100.0, "77": 3.0}
    extra = {"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.3}
    r = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        presence_penalty=1.2,
        frequency_penalty=0.6,
        logit_bias=bias,
        extra_body=extra,
    )
    got = r.choices[0].model_extra["token_ids"]
    p = SamplingParams(
        presence_penalty=1.2,
        frequency_penalty=0.6,
        repetition_penalty=1.3,
        logit_bias={int(k): v for k, v in bias.items()},
    )
    assert got == ref_greedy(offline.engine, PROMPT, p, 8)
    assert got != plain


def test_allowed_token_ids(server, offline):
    """vLLM's allowed_token_ids: greedy tokens are the arg-max over those ids, as a reference computes them."""
    allowed = [5, 40, 77, 300, 301]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "allowed_token_ids": allowed}, timeout=60)
    got = r.json()["choices"][0]["token_ids"]
    assert got == ref_greedy(offline.engine, PROMPT, SamplingParams(allowed_token_ids=allowed), 6)
    assert set(got) <= set(allowed)


def test_bad_words(server, offline):
    """vLLM's bad_words: each word's token sequences (at a text's start and after a space) never end the output;
    greedy tokens equal a reference that bans them step by step; a word of spaces is a 400 naming the field."""
    from mlaserve.engine.engine import bad_word_ids

    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    url = f"{server.url}/v1/completions"
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    words = [offline.tokenizer.decode(plain["token_ids"][2:4]), offline.tokenizer.decode(plain["token_ids"][6:7])]
    seqs = bad_word_ids(offline.tokenizer, words)
    got = httpx.post(url, json={**body, "bad_words": words}, timeout=60).json()["choices"][0]["token_ids"]
    assert got == ref_greedy_banned(offline.engine, PROMPT, seqs, 12) and got != plain["token_ids"]
    assert not any(tuple(got[i : i + len(q)]) == q for q in seqs for i in range(len(got)))
    r = httpx.post(url, json={**body, "bad_words": ["  "]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


def test_echo_with_prompt_logprobs(server, offline, client):
    prompt = PROMPT[:12]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 14 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = model_logits(offline.engine, prompt).log_softmax(-1)
    want = [ref[i - 1, prompt[i]].item() for i in range(1, 12)]
    assert lp.token_logprobs[1:12] == pytest.approx(want, abs=1e-4)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert r.choices[0].text.startswith(text)
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}  # vLLM's extra, no echo
    plp = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and [plp[i][str(prompt[i])]["logprob"] for i in range(1, 12)] == pytest.approx(want, abs=1e-4)


def test_echo_with_max_tokens_0_scores_the_prompt(server, offline):
    """max_tokens 0 with echo (vLLM's form, as eval harnesses score a text): the choice is the prompt alone, its
    logprobs the model's, no completion token counted; streamed the same; without echo a 400 naming max_tokens."""
    prompt, url = PROMPT[:12], f"{server.url}/v1/completions"
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    r = httpx.post(url, json=body, timeout=60).json()
    c, text = r["choices"][0], httpx.post(f"{server.url}/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert c["text"] == text and c["finish_reason"] == "length" and len(c["logprobs"]["tokens"]) == 12
    ref = model_logits(offline.engine, prompt).log_softmax(-1)
    want = [ref[i - 1, prompt[i]].item() for i in range(1, 12)]
    assert c["logprobs"]["token_logprobs"][0] is None
    assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == 12
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = [json.loads(ln[5:]) for ln in s.iter_lines() if ln.startswith("data:") and "[DONE]" not in ln]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text
    assert events[-1]["usage"]["completion_tokens"] == 0
    r = httpx.post(url, json={**body, "echo": False}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert_idle_no_leak(server)


def test_best_of(client):
    r = client.completions.create(
        model="tiny", prompt=PROMPT, n=2, best_of=4, max_tokens=4, temperature=1.0, seed=3, logprobs=0
    )
    sums = [sum(c.logprobs.token_logprobs) for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(sums) == 2 and sums[0] >= sums[1]
    assert r.usage.completion_tokens == 16  # all four sequences were generated


def test_endpoints(server):
    u = server.url
    assert httpx.get(f"{u}/version").json()["version"]
    t = httpx.post(f"{u}/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] > 0
    assert httpx.post(f"{u}/detokenize", json={"tokens": t["tokens"]}).json()["prompt"].endswith("hello world")
    assert httpx.get(f"{u}/v1/models/tiny").json()["id"] == "tiny"
    assert httpx.get(f"{u}/v1/models/other").status_code == 404
    bad = httpx.post(f"{u}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{u}/tokenize", json={}).status_code == 400
