"""Endpoints against the real app: greedy outputs equal mlaserve.LLM offline, SSE has one event per step with its
token_ids, usage and logprobs have the right shapes, and /v1/models, /health and /metrics say what they should."""

import json

import httpx
import pytest

from .conftest import assert_idle_no_leak, greedy_ids, scrape

PROMPT_IDS = [[5, 17, 300, 42, 9, 260, 77], [100 + i for i in range(40)]]


def sse_chunks(resp: httpx.Response) -> list[dict]:
    """Every `data:` payload of an SSE response; asserts it ends with [DONE]."""
    lines = [ln[5:].strip() for ln in resp.iter_lines() if ln.startswith("data:")]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(x) for x in lines[:-1]]


def test_completion_matches_offline(server, offline):
    body = {
        "model": "tiny",
        "prompt": "Hello, my name is",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    want = offline.generate(["Hello, my name is"], _sp(12), use_tqdm=False)[0]
    assert c["token_ids"] == want.token_ids and c["text"] == want.text and c["finish_reason"] == "length"
    u = r.json()["usage"]
    assert u["prompt_tokens"] == len(offline.tokenizer.encode("Hello, my name is", True))
    assert u["completion_tokens"] == 12 and u["total_tokens"] == u["prompt_tokens"] + 12


def _sp(n, **kw):
    from mlaserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_stream_several_prompts_one_event_per_step(server, offline):
    body = {
        "prompt": PROMPT_IDS,
        "max_tokens": 9,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_chunks(r)
    ids = {0: [], 1: []}
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        assert len(c["token_ids"]) == 1, "one event per engine step, each carrying that step's token"
        ids[c["index"]] += c["token_ids"]
        assert (c["finish_reason"] is not None) == (len(ids[c["index"]]) == 9)
    for i, p in enumerate(PROMPT_IDS):
        assert ids[i] == greedy_ids(offline, p, 9, ignore_eos=True)
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 18
    assert usage["prompt_tokens"] == sum(map(len, PROMPT_IDS))
    assert_idle_no_leak(server)


def offline_steps(llm, ids, params) -> list[tuple[list[int], str]]:
    """(token ids, text) of every engine step of one request run offline."""
    rid = llm.engine.add_request(ids, params)
    steps = []
    while llm.engine.has_unfinished():
        steps += [(o.new_token_ids, o.new_text) for o in llm.engine.step() if o.request_id == rid]
    return steps


def test_events_equal_offline_steps_even_without_text(server, offline):
    """Byte tokens that make no whole character yet: the step's event still comes, with its token_ids and text ''."""
    for start in range(0, 250, 10):
        prompt = [start, start + 1, start + 2]
        steps = offline_steps(offline, prompt, _sp(32))
        if any(text == "" for _, text in steps):
            break
    else:
        pytest.fail("no greedy run with a textless step found")
    body = {
        "prompt": prompt,
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = [c["choices"][0] for c in sse_chunks(r)]
    assert [(e["token_ids"], e["text"]) for e in events] == steps


def test_chat_matches_offline(server, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    tok = offline.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), False)
    want = greedy_ids(offline, ids, 10, ignore_eos=True)
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["token_ids"] == want and c["message"]["role"] == "assistant"
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        chunks = sse_chunks(r)
    deltas = [ch["choices"][0] for ch in chunks[:-1]]
    assert deltas[0]["delta"]["role"] == "assistant" and len(deltas) == 10
    assert [t for d in deltas for t in d["token_ids"]] == want
    assert "".join(d["delta"]["content"] for d in deltas) == c["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_logprobs_shapes(server, offline):
    body = {"prompt": PROMPT_IDS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    lp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    want = offline.generate([PROMPT_IDS[0]], _sp(5, logprobs=0), use_tqdm=False)[0].outputs[0].logprobs
    assert lp["token_logprobs"] == pytest.approx(want, abs=1e-4)
    assert len(lp["tokens"]) == len(lp["text_offset"]) == 5 and lp["text_offset"][0] == 0
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        streamed = [c["choices"][0]["logprobs"] for c in sse_chunks(r)]
    assert [x for s in streamed for x in s["token_logprobs"]] == lp["token_logprobs"]
    assert [x for s in streamed for x in s["text_offset"]] == lp["text_offset"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "logprobs": True, "temperature": 0}
    content = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    entries = content["logprobs"]["content"]
    assert len(entries) == 3 and all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in entries)


def test_models_health_metrics(server):
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["vocab_size"] == 512 and card["max_model_len"] == 4096
    assert card["bos_token_id"] == 256 and card["eos_token_ids"] == [257]
    assert set(card["special_token_ids"]) >= {256, 257}
    assert httpx.get(f"{server.url}/v1/models/tiny").json()["id"] == "tiny"
    assert httpx.get(f"{server.url}/v1/models/other").status_code == 404
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    m = scrape(server.url)
    for name in (
        "request_success_total",
        "time_to_first_token_seconds_count",
        "time_per_output_token_seconds_count",
        "e2e_request_latency_seconds_count",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_pages_used",
        "prefix_cache_hits_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "generation_tokens_total",
        "request_errors_total",
    ):
        assert f"mlaserve:{name}" in m, name


def test_stop_string_and_reason(server, offline):
    want = offline.generate([PROMPT_IDS[1]], _sp(16), use_tqdm=False)[0]
    stop = want.text[3:6]
    if len(stop) < 3 or stop.startswith("\ufffd"):
        pytest.skip("this model's greedy text has no clean stop string")
    body = {"prompt": PROMPT_IDS[1], "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": stop}
    c = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop and c["text"] == want.text[: want.text.find(stop)]


def test_stop_string_kept_with_include_stop_str_in_output(server, offline):
    """vLLM's include_stop_str_in_output: the text ends with the matched stop string, streamed or not."""
    want = offline.generate([PROMPT_IDS[1]], _sp(16), use_tqdm=False)[0]
    stop = want.text[3:6]
    if len(stop) < 3 or stop.startswith("\ufffd"):
        pytest.skip("this model's greedy text has no clean stop string")
    cut = want.text[: want.text.find(stop) + len(stop)]
    body = {"prompt": PROMPT_IDS[1], "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    body["include_stop_str_in_output"] = True
    c = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop and c["text"] == cut
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = sse_chunks(r)
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    body["include_stop_str_in_output"] = "yes"  # strict: a boolean only
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "include_stop_str_in_output"


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, offline):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are the prompt (ids or text); -1 keeps what leaves
    room for max_tokens; a text over the untokenized length limit is tokenized and cut instead of refused."""
    url, ids = f"{server.url}/v1/completions", PROMPT_IDS[1]
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(url, json={**body, "truncate_prompt_tokens": 10}, timeout=60).json()
    assert r["usage"]["prompt_tokens"] == 10 and r["choices"][0]["token_ids"] == greedy_ids(offline, ids[-10:], 6)
    n = server.llm.engine.max_model_len
    long = [100 + i % 50 for i in range(n + 20)]
    r = httpx.post(url, json={**body, "prompt": long, "truncate_prompt_tokens": -1}, timeout=60).json()
    assert r["usage"]["prompt_tokens"] == n - 6 and r["choices"][0]["token_ids"] == greedy_ids(
        offline, long[-(n - 6) :], 6
    )
    text = "hello " * (n * 40)  # more characters than max_model_len tokens could hold: refused untokenized
    assert httpx.post(url, json={**body, "prompt": text}, timeout=60).status_code == 413
    r = httpx.post(url, json={**body, "prompt": text, "truncate_prompt_tokens": 8}, timeout=60).json()
    want = offline.tokenizer.encode(text, True)[-8:]
    assert r["usage"]["prompt_tokens"] == 8 and r["choices"][0]["token_ids"] == greedy_ids(offline, want, 6)
    chat = {"messages": [{"role": "user", "content": "hello " * 30}], "max_tokens": 2, "truncate_prompt_tokens": 5}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5, r.text
    for bad in (0, n + 1, "5", -2):
        r = httpx.post(url, json={**body, "truncate_prompt_tokens": bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (bad, r.text)
    assert_idle_no_leak(server)


def test_continue_final_message_prefills_the_reply(server, offline):
    """continue_final_message (or a last assistant message marked partial / prefix): the prompt ends with the
    assistant's prefilled text, left open (as /tokenize renders it), and the reply continues it: greedy tokens equal
    the offline engine's on those ids."""
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hello, my name"}]
    tok = httpx.post(f"{server.url}/tokenize", json={"messages": msgs, "continue_final_message": True}).json()
    text = offline.tokenizer.decode(tok["tokens"], skip_special_tokens=False)
    assert text.endswith("Hello, my name") and text.count("<|im_end|>") == 1
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "continue_final_message": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == tok["count"]
    want = greedy_ids(offline, tok["tokens"], 6)
    assert r.json()["choices"][0]["token_ids"] == want
    for mark in ("partial", "prefix"):  # Moonshot's and DeepSeek's way to ask for it
        marked = [msgs[0], {**msgs[1], mark: True}]
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "messages": marked}, timeout=60).json()
        assert r["usage"]["prompt_tokens"] == tok["count"] and r["choices"][0]["token_ids"] == want
    both = {**body, "continue_final_message": True, "add_generation_prompt": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=both, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    assert_idle_no_leak(server)


def test_reset_prefix_cache_starts_the_next_prompt_cold(server, offline):
    """vLLM's POST /reset_prefix_cache and SGLang's /flush_cache (no body, no content type): a repeated prompt hits
    the prefix cache, and after a reset it is computed whole; refused with a 409 while a request is unfinished."""
    url, ids = server.url, [7 + i % 90 for i in range(64)]
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0}
    cached = lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]["prompt_tokens_details"]  # noqa: E731
    cached()
    assert cached()["cached_tokens"] > 0
    r = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
    assert r.status_code == 200 and r.json()["freed_pages"] > 0, r.text
    assert cached()["cached_tokens"] == 0
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{url}/flush_cache", timeout=60).status_code == 200
        assert cached()["cached_tokens"] == 0
    room = server.llm.engine.max_model_len - len(ids)
    long = {"prompt": ids, "max_tokens": room, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as s:
        lines = s.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the request
        assert s.status_code == 200 and next(lines).startswith("data: {")  # the request is running
        r = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
        assert r.status_code == 409 and "running or waiting" in r.json()["error"]["message"], r.text
    assert offline.reset_prefix_cache() is True  # LLM's, as vLLM's
    assert_idle_no_leak(server)


def test_prediction_accepted_and_ignored_without_ngram(server):
    """OpenAI's prediction on a server without NGRAM speculation: the same reply, nothing accepted; a malformed
    one is still a 400 naming the field."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    url = f"{server.url}/v1/chat/completions"
    a = httpx.post(url, json=body, timeout=60).json()
    b = httpx.post(url, json={**body, "prediction": {"type": "content", "content": "hello"}}, timeout=60).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert b["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    r = httpx.post(url, json={**body, "prediction": {"content": "x"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", r.text
    assert_idle_no_leak(server)
