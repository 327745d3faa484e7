"""`mlaserve serve` in a subprocess with no MODEL (the embedded default, made in a fresh cache), driven by the
official `openai` client, unmodified: streamed completion and chat equal the offline greedy tokens and the usage
counts are right; errors arrive as the client's typed exceptions; SIGINT stops the server with status 0."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from mlaserve import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "MLASERVE_CACHE": str(cache), "PYTHONPATH": path}
    log = (cache / "server.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlaserve",
            "--log-level",
            "warning",
            "serve",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--num-pages",
            "256",
            "--page-size",
            "16",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"mlaserve serve exited: {(cache / 'server.log').read_text()[-2000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "mlaserve serve did not come up"
        time.sleep(0.2)
    yield url, cache / "tiny-random-v1"
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=30) == 0, (cache / "server.log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def reference(cli_server):
    return LLM(str(cli_server[1]), device="cpu", num_pages=256, page_size=16)


def _greedy(llm, ids, n):
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]


def test_default_model_and_client_streams_completion(cli_server, reference):
    url, _ = cli_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny-random-v1"]
    prompt = "Hello, my name is"
    ids = reference.tokenizer.encode(prompt, True)
    want = _greedy(reference, ids, 8)
    stream = client.completions.create(
        model="tiny-random-v1",
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    text, token_ids, usage = "", [], None
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].text
            token_ids += ch.choices[0].model_extra["token_ids"]
        usage = ch.usage or usage
    assert token_ids == want.token_ids and text == want.text
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 8, len(ids) + 8)
    full = client.completions.create(
        model="tiny-random-v1", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].text == want.text and full.usage.completion_tokens == 8


def test_client_streams_chat(cli_server, reference):
    url, _ = cli_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is MLA?"}]
    tok = reference.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), False)
    want = _greedy(reference, ids, 10)
    stream = client.chat.completions.create(
        model="tiny-random-v1",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    content, roles, usage, finish = "", set(), None, None
    for ch in stream:
        if ch.choices:
            d = ch.choices[0].delta
            content += d.content or ""
            roles.add(d.role)
            finish = ch.choices[0].finish_reason or finish
        usage = ch.usage or usage
    assert content == want.text and "assistant" in roles and finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 10)
    full = client.chat.completions.create(
        model="tiny-random-v1", messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].message.content == want.text and full.usage.completion_tokens == 10


def test_client_sees_typed_errors(cli_server):
    url, _ = cli_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny-random-v1", prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(
            model="tiny-random-v1", messages=[{"role": "user", "content": "x"}], max_tokens=10**9, stream=True
        )
