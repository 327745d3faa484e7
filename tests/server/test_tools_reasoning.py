"""Tool calls and reasoning through the official openai client, streamed and not, on the tiny model with each
family's tokenizer, template and marker tokens (tests/server/family_models.py scripts the outputs); DeepSeek's
prompt details (BOS, null content, generation_config defaults); bad tools, templates and calls."""

import json

import httpx
import openai
import pytest

from mlaserve.server.chat_tools import ChatOptions

from .conftest import greedy_ids, start_server
from .family_models import DS31_TEMPLATE, deepseek_model, kimi_model, script_outputs

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
KIMI_SCRIPTS = {
    "call": "<think>Need the weather.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>"
    'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    "bad": "<think>hm</think>x<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_end|>",
    "answer": "<think>Sunny, it says.</think>It is sunny in Paris.",
    "decide": "<think>Weather, so a call.</think>",  # open-ended: the model goes on under the forced call's grammar
}
DS_SCRIPTS = {
    "call": "Think hard.</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "think": "Some\nthoughts.</think>\n\nThe answer.",
    "decide": "Weather, so a call.</think>",
}

DS31_SCRIPTS = {
    "call": "Let me see.</think>Calling.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "plain": "Sunny.",
}


def _client(run) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{run.url}/v1", api_key="none", max_retries=0)


def _stream(client, **kw) -> tuple[dict, str]:
    """Merge a stream's deltas as a client does -> (message, finish_reason); message["fragments"]: how many deltas
    carried argument text."""
    msg = {"reasoning_content": "", "content": "", "tool_calls": {}, "fragments": 0}
    finish = None
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            d = c.delta
            msg["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
            msg["content"] += d.content or ""
            for tc in d.tool_calls or []:
                slot = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] = tc.function.name
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
                msg["fragments"] += bool(tc.function and tc.function.arguments)
            finish = c.finish_reason or finish
    return msg, finish


@pytest.fixture(scope="module")
def kimi(tiny_ckpt, tmp_path_factory):
    folder = kimi_model(tiny_ckpt, str(tmp_path_factory.mktemp("kimi-tiny")))
    opts = ChatOptions(tool_call_parser="kimi_k2", reasoning_parser="kimi_k2", enable_auto_tool_choice=True)
    run = start_server(folder, name="kimi", chat_options=opts)
    script_outputs(run.llm, KIMI_SCRIPTS, open_ended=("decide",))
    yield run
    assert run.stop() == 0


@pytest.fixture(scope="module")
def deepseek(tiny_ckpt, tmp_path_factory):
    folder = deepseek_model(tiny_ckpt, str(tmp_path_factory.mktemp("ds-tiny")), {"temperature": 0.0, "top_p": 0.95})
    opts = ChatOptions(tool_call_parser="deepseek_v3", reasoning_parser="deepseek_r1", enable_auto_tool_choice=True)
    run = start_server(folder, name="ds", chat_options=opts)
    script_outputs(run.llm, DS_SCRIPTS, open_ended=("decide",))
    yield run
    assert run.stop() == 0


@pytest.fixture(scope="module")
def deepseek31(tiny_ckpt, tmp_path_factory):
    folder = deepseek_model(tiny_ckpt, str(tmp_path_factory.mktemp("ds31-tiny")), template=DS31_TEMPLATE)
    opts = ChatOptions(tool_call_parser="deepseek_v31", reasoning_parser="deepseek_v3", enable_auto_tool_choice=True)
    run = start_server(folder, name="ds31", chat_options=opts)
    script_outputs(run.llm, DS31_SCRIPTS)
    yield run
    assert run.stop() == 0


def test_deepseek_v31_tool_call_and_hybrid_reasoning(deepseek31):
    """DeepSeek-V3.1's call format (name<｜tool▁sep｜>arguments) and its hybrid thinking: reasoning only when the
    request's chat_template_kwargs turns thinking on (the template then opens <think>)."""
    client = _client(deepseek31)
    msgs = [{"role": "user", "content": "weather? [script:call]"}]
    think_id = deepseek31.llm.engine.tokenizer.backend.token_to_id("<think>")
    for thinking, last in ((True, think_id), (False, think_id + 1)):  # the prompt opens or closes the reasoning
        body = {"messages": msgs, "chat_template_kwargs": {"thinking": thinking}}
        assert httpx.post(f"{deepseek31.url}/tokenize", json=body).json()["tokens"][-1] == last
    kw = dict(model="ds31", messages=msgs, tools=[WEATHER], extra_body={"chat_template_kwargs": {"thinking": True}})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Calling."
    assert c.message.model_extra["reasoning_content"] == "Let me see."
    (tc,) = c.message.tool_calls
    assert tc.id.startswith("chatcmpl-tool-") and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"}
    msg, finish = _stream(client, **kw)
    assert finish == "tool_calls" and msg["content"] == "Calling." and msg["reasoning_content"] == "Let me see."
    assert [(v["name"], v["arguments"]) for v in msg["tool_calls"].values()] == [("get_weather", tc.function.arguments)]
    # thinking off (the template's default): no reasoning parsed, the text is the content
    plain = dict(model="ds31", messages=[{"role": "user", "content": "[script:plain]"}], tools=[WEATHER])
    c = client.chat.completions.create(**plain).choices[0]
    assert c.message.content == "Sunny." and c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.model_extra["reasoning_content"] is None
    msg, finish = _stream(client, **plain)
    assert msg["content"] == "Sunny." and msg["reasoning_content"] == "" and finish == "stop"


def test_kimi_tool_call_and_reasoning(kimi):
    client = _client(kimi)
    kw = dict(model="kimi", messages=[{"role": "user", "content": "weather? [script:call]"}], tools=[WEATHER])
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Checking."
    assert c.message.model_extra["reasoning_content"] == "Need the weather."
    (tc,) = c.message.tool_calls
    assert tc.id == "functions.get_weather:0" and tc.type == "function" and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"}
    msg, finish = _stream(client, **kw)
    assert finish == "tool_calls" and msg["content"] == "Checking." and msg["reasoning_content"] == "Need the weather."
    assert msg["tool_calls"] == {0: {"id": tc.id, "name": "get_weather", "arguments": tc.function.arguments}}
    # the next turn: the call (content null) and its result go back through the template
    turn2 = [
        *kw["messages"],
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": tc.id, "content": "sunny"},
        {"role": "user", "content": "so? [script:answer]"},
    ]
    r2 = client.chat.completions.create(model="kimi", messages=turn2, tools=[WEATHER])
    assert r2.choices[0].message.content == "It is sunny in Paris." and r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.model_extra["reasoning_content"] == "Sunny, it says."
    assert not r2.choices[0].message.tool_calls
    # skip_special_tokens false: every marker shows, and the parsers still split them off
    raw = client.chat.completions.create(**kw, tool_choice="none", extra_body={"skip_special_tokens": False})
    assert raw.choices[0].message.content == KIMI_SCRIPTS["call"][len("<think>Need the weather.</think>") :]
    assert raw.choices[0].finish_reason == "stop" and not raw.choices[0].message.tool_calls


def test_kimi_malformed_call_is_raw_text(kimi):
    client = _client(kimi)
    kw = dict(model="kimi", messages=[{"role": "user", "content": "[script:bad]"}], tools=[WEATHER])
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    raw = "x<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_end|>"
    assert c.finish_reason == "stop" and not c.message.tool_calls and c.message.content == raw
    msg, finish = _stream(client, **kw)
    assert finish == "stop" and msg["content"] == raw and not msg["tool_calls"]


def test_deepseek_tool_call_and_reasoning(deepseek):
    client = _client(deepseek)
    kw = dict(model="ds", messages=[{"role": "user", "content": "[script:call]"}], tools=[WEATHER])
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.model_extra["reasoning_content"] == "Think hard."
    (tc,) = c.message.tool_calls
    assert tc.id.startswith("chatcmpl-tool-") and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"}
    msg, finish = _stream(client, **kw)
    assert finish == "tool_calls" and msg["reasoning_content"] == "Think hard."
    assert [(v["name"], v["arguments"]) for v in msg["tool_calls"].values()] == [("get_weather", tc.function.arguments)]
    # without tools, reasoning alone; the null content of a tool-call turn reaches DeepSeek's `content is none`
    turn = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": tc.id, "content": "sunny"},
        {"role": "user", "content": "[script:think]"},
    ]
    r = client.chat.completions.create(model="ds", messages=turn)
    assert r.choices[0].message.content == "\n\nThe answer." and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.model_extra["reasoning_content"] == "Some\nthoughts."
    msg, finish = _stream(client, model="ds", messages=turn)
    assert msg["content"] == "\n\nThe answer." and msg["reasoning_content"] == "Some\nthoughts." and finish == "stop"


def test_deepseek_bos_and_generation_config(deepseek, offline):
    tok = deepseek.llm.engine.tokenizer
    assert tok.encode("hi", add_special_tokens=True)[0] == tok.bos_token_id == 256
    client = _client(deepseek)
    # generation_config.json says temperature 0: a request that sets none is greedy
    r = client.completions.create(model="ds", prompt=[5, 6, 7], max_tokens=6, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == greedy_ids(offline, [5, 6, 7], 6)
    # completions on a string prompt start with BOS (add_bos_token)
    r = client.completions.create(
        model="ds", prompt="hi", max_tokens=1, echo=True, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].model_extra["prompt_token_ids"][0] == 256


def test_bad_tools_templates_and_choices(kimi):
    client = _client(kimi)
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\].function.parameters"):
        client.chat.completions.create(model="kimi", messages=[{"role": "user", "content": "x"}], tools=[bad_schema])
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model="kimi",
            messages=[{"role": "user", "content": "x"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="unknown role developer"):  # the template raises
        client.chat.completions.create(model="kimi", messages=[{"role": "developer", "content": "x"}])


def test_auto_tool_choice_needs_the_flags(server):
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        _client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], tools=[WEATHER]
        )
    r = _client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], tools=[WEATHER], tool_choice="none", max_tokens=2
    )
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("family", ["kimi", "deepseek"])
def test_forced_tool_choice_after_reasoning(family, request):
    """tool_choice named / required on a server with reasoning and tool-call parsers: the model reasons freely (here
    scripted up to </think>), the grammar holds from the end of reasoning (vLLM), and the reasoning comes back as
    reasoning_content, the grammar's JSON as the call, its arguments streamed in fragments. A model that never ends
    its reasoning makes no call. Kimi with thinking off: the grammar holds from the first token, no reasoning."""
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    client = _client(request.getfixturevalue(family))
    name = {"kimi": "kimi", "deepseek": "ds"}[family]
    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}  # a random model ends it
    kw = dict(model=name, messages=[{"role": "user", "content": "Weather? [script:decide]"}], tools=[tool])
    kw.update(max_tokens=120, temperature=0)
    cases = [({}, "Weather, so a call.")]
    if family == "kimi":
        cases.append(({"chat_template_kwargs": {"thinking": False}}, None))
    for extra, reasoning in cases:
        if reasoning is None:
            kw["messages"] = [{"role": "user", "content": "Weather?"}]
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            c = client.chat.completions.create(**kw, tool_choice=choice, extra_body=extra).choices[0]
            assert c.finish_reason == "tool_calls", c
            assert c.message.content is None and c.message.model_extra["reasoning_content"] == reasoning
            assert [t.function.name for t in c.message.tool_calls][:1] == ["get_weather"]
            for t in c.message.tool_calls:
                jsonschema.validate(json.loads(t.function.arguments), params)
            msg, finish = _stream(client, **kw, tool_choice=choice, extra_body=extra)
            assert finish == "tool_calls" and msg["reasoning_content"] == (reasoning or "") and msg["content"] == ""
            got = [(v["name"], v["arguments"]) for _, v in sorted(msg["tool_calls"].items())]
            assert got == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
            assert msg["fragments"] > len(got), "the arguments stream in pieces"
            ids = [t.id for t in c.message.tool_calls]
            if family == "kimi":  # Kimi's ids, as its template takes them back
                assert ids == [f"functions.{t.function.name}:{i}" for i, t in enumerate(c.message.tool_calls)]
                assert [v["id"] for _, v in sorted(msg["tool_calls"].items())] == ids
            else:
                assert all(i.startswith("chatcmpl-tool-") for i in ids)
    if family == "kimi":  # a conversation with one call before: the next call is Kimi's index 1
        (tc,) = c.message.tool_calls[:1]
        history = [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [tc.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": tc.id, "content": "sunny"},
            {"role": "user", "content": "And now? [script:decide]"},
        ]
        r = client.chat.completions.create(**{**kw, "messages": history}, tool_choice=choice).choices[0]
        assert r.message.tool_calls[0].id == "functions.get_weather:1"
    # the model never writes </think> (no script): all reasoning, no call, the engine's finish_reason
    kw["messages"] = [{"role": "user", "content": "Weather?"}]
    c = client.chat.completions.create(**{**kw, "max_tokens": 12}, tool_choice="required").choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls and c.message.content is None
    assert c.message.model_extra["reasoning_content"]
