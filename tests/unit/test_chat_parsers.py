"""Tool-call and reasoning parsers on the marker formats of each family, fed whole and token by token: the streamed
deltas add up to the non-streamed message, and malformed calls come back as the raw text."""

import json

import pytest

from mlaserve.server.chat_output import ChoiceOutput
from mlaserve.server.reasoning import REASONING_PARSERS
from mlaserve.server.tool_parsers import TOOL_PARSERS

KIMI = (
    "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>{"a": 1, "b": 2}'
    "<|tool_call_end|><|tool_calls_section_end|>"
)
DSV3 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n'
    '{"a": 1,\n "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DSV31 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1, "b": 2}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)


def _pieces(text: str, step: int):
    return [text[i : i + step] for i in range(0, len(text), step)]


def _stream(out: ChoiceOutput, text: str, step: int) -> dict:
    """Feed text in pieces; merge the deltas as a client does."""
    merged = {"reasoning_content": "", "content": "", "tool_calls": {}}
    parts = _pieces(text, step)
    for k, piece in enumerate(parts):
        d = out.delta(piece, k == len(parts) - 1)
        merged["reasoning_content"] += d.get("reasoning_content", "")
        merged["content"] += d.get("content", "")
        for tc in d.get("tool_calls", []):
            slot = merged["tool_calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert slot["id"] is None, "a call's id is sent once"
                slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
            slot["arguments"] += tc["function"].get("arguments", "")
    return merged


@pytest.mark.parametrize(
    "parser,text,content", [("kimi_k2", KIMI, "Let me check."), ("deepseek_v3", DSV3, ""), ("deepseek_v31", DSV31, "")]
)
@pytest.mark.parametrize("step", [1, 3, 7, 10_000])
def test_tool_calls_streamed_equal_whole(parser, text, content, step):
    whole = ChoiceOutput(None, TOOL_PARSERS[parser]())
    whole.text = text
    msg = whole.message()
    calls = msg["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"a": 1, "b": 2}]
    assert msg["content"] == (content or None) and whole.finish_reason("stop") == "tool_calls"
    if parser == "kimi_k2":
        assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.add:1"]
    else:
        assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    streamed = ChoiceOutput(None, TOOL_PARSERS[parser]())
    got = _stream(streamed, text, step)
    assert got["content"] == content
    assert [(v["name"], v["arguments"]) for _, v in sorted(got["tool_calls"].items())] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert streamed.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize(
    "parser,bad",
    [
        (
            "kimi_k2",
            "ok<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}<|tool_call_end|>",
        ),
        ("kimi_k2", 'ok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": '),
        ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{}<｜tool▁call▁end｜>"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜>nothing"),
    ],
)
@pytest.mark.parametrize("step", [1, 10_000])
def test_malformed_calls_are_raw_content(parser, bad, step):
    whole = ChoiceOutput(None, TOOL_PARSERS[parser]())
    whole.text = bad
    msg = whole.message()
    assert msg["content"] == bad and "tool_calls" not in msg and whole.finish_reason("length") == "length"
    if step == 10_000:
        got = _stream(ChoiceOutput(None, TOOL_PARSERS[parser]()), bad, step)
        assert got["content"] == bad and not got["tool_calls"]


@pytest.mark.parametrize("step", [1, 2, 5, 10_000])
def test_reasoning_then_content_and_tools(step):
    text = "<think>I should\ncall it.</think>Calling." + KIMI[len("Let me check.") :]
    for name in ("kimi_k2", "deepseek_r1"):
        out = ChoiceOutput(REASONING_PARSERS[name](), TOOL_PARSERS["kimi_k2"]())
        got = _stream(out, text, step)
        assert got["reasoning_content"] == "I should\ncall it." and got["content"] == "Calling."
        assert [v["name"] for v in got["tool_calls"].values()] == ["get_weather", "add"]
    # R1: the template opened <think>; no end yet: all reasoning. Kimi: a tool section ends the reasoning.
    r1 = ChoiceOutput(REASONING_PARSERS["deepseek_r1"](), None)
    r1.text = "still thinking"
    assert r1.message() == {"role": "assistant", "content": None, "reasoning_content": "still thinking"}
    k = ChoiceOutput(REASONING_PARSERS["kimi_k2"](), TOOL_PARSERS["kimi_k2"]())
    k.text = "hmm" + KIMI[len("Let me check.") :]
    m = k.message()
    assert m["reasoning_content"] == "hmm" and len(m["tool_calls"]) == 2 and m["content"] is None
    off = ChoiceOutput(REASONING_PARSERS["kimi_k2"]({"thinking": False}), None)
    off.text = "plain</think>x"
    assert off.message()["content"] == "plain</think>x"


def test_forced_tool_choice_without_a_parser():
    """tool_choice named / required with no --tool-call-parser: the output read in vLLM's guided-JSON forms."""
    named = ChoiceOutput(None, None, forced="get_weather")
    assert named.delta('{"city":', False) == {}  # nothing until the whole text is known
    d = named.delta(' "Paris"}', True)
    assert d["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    req = ChoiceOutput(None, None, forced="required")
    req.text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert [c["function"]["name"] for c in req.message()["tool_calls"]] == ["a", "b"]
    bad = ChoiceOutput(None, None, forced="required")
    bad.text = "not json"
    assert bad.message()["content"] == "not json" and bad.finish_reason("stop") == "stop"
