"""`mlaserve serve` in a subprocess with no MODEL (the embedded default, the Python code model shipped in the
package), driven by the official `openai` client, unmodified: streamed completion and chat (through a
--chat-template the test writes: the code model has none) equal the offline greedy tokens and the usage counts are
right; errors arrive as the client's typed exceptions; SIGINT stops the server with status 0."""

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

from mlaserve import LLM, SamplingParams, default_model_path  # noqa: E402
from mlaserve.config import generation_sampling_defaults  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NAME = "pycode-13m"  # the default model's folder name, which /v1/models serves it as
TEMPLATE = (
    "{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}# assistant:"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "MLASERVE_CACHE": str(cache), "PYTHONPATH": path}
    (cache / "chat.jinja").write_text(TEMPLATE)
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
            "--chat-template",
            str(cache / "chat.jinja"),
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
    yield url, default_model_path()
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=30) == 0, (cache / "server.log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def reference(cli_server):
    return LLM(cli_server[1], device="cpu", num_pages=256, page_size=16)


def _greedy(llm, ids, n):
    """What the server answers a request that sets only temperature 0: the model's generation_config.json gives the
    fields left unset (its repetition penalty), as vLLM's --generation-config auto."""
    rp = generation_sampling_defaults(default_model_path()).get("repetition_penalty", 1.0)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=rp)
    return llm.generate([ids], params, use_tqdm=False)[0]


def test_default_model_and_client_streams_completion(cli_server, reference):
    url, _ = cli_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [NAME]
    prompt = "def read_json(path):"
    ids = reference.tokenizer.encode(prompt, True)
    want = _greedy(reference, ids, 8)
    stream = client.completions.create(
        model=NAME,
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
        model=NAME, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].text == want.text and full.usage.completion_tokens == 8


def test_client_streams_chat(cli_server, reference):
    url, _ = cli_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is MLA?"}]
    tok = reference.tokenizer
    ids = tok.encode("# user: What is MLA?\n# assistant:", False)  # TEMPLATE, rendered
    want = _greedy(reference, ids, 10)
    stream = client.chat.completions.create(
        model=NAME,
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
        model=NAME, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].message.content == want.text and full.usage.completion_tokens == 10


def test_client_sees_typed_errors(cli_server):
    url, _ = cli_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=10**9, stream=True
        )
