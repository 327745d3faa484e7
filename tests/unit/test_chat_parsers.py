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


NAMED_ARGS = '{"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}'
REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "Rome", "x": {"y": [true, null]}}}, '
    '{"name": "add", "parameters": {"a": 1, "b": -2.5e3}}]'
)


@pytest.mark.parametrize(
    "forced,text", [("get_weather", NAMED_ARGS), ("required", REQUIRED)], ids=["named", "required"]
)
def test_forced_calls_stream_their_arguments_in_fragments(forced, text):
    """tool_choice named / required: the arguments stream as they are generated (vLLM), each fragment the model's
    own JSON text, never text the final answer takes back, and the stream adds up to the message."""
    whole = ChoiceOutput(None, None, forced=forced)
    whole.text = text
    msg = whole.message()
    want = [("get_weather", {"city": "Paris", "days": [1, 2], "note": 'a "}" b'})]
    if forced == "required":
        want = [("get_weather", {"city": "Rome", "x": {"y": [True, None]}}), ("add", {"a": 1, "b": -2500.0})]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == want
    assert msg["content"] is None and whole.finish_reason("stop") == "tool_calls"
    out = ChoiceOutput(None, None, forced=forced)
    sent: dict[int, list[str]] = {}
    final_args = [c["function"]["arguments"] for c in msg["tool_calls"]]
    for k, ch in enumerate(text):
        d = out.delta(ch, k == len(text) - 1)
        assert "content" not in d and "reasoning_content" not in d
        for tc in d.get("tool_calls", []):
            frags = sent.setdefault(tc["index"], [])
            assert ("id" in tc) == (not frags), "the first delta of a call carries its id and name, the rest do not"
            frags.append(tc["function"]["arguments"])
            assert final_args[tc["index"]].startswith("".join(frags))
    assert ["".join(f) for _, f in sorted(sent.items())] == final_args
    assert all(len(f) > 5 for f in sent.values())  # streamed in many pieces, not one at the end
    assert out.finish_reason(None) is None and out.finish_reason("stop") == "tool_calls"


def test_forced_call_ids_kimi_style():
    """With the kimi_k2 parser, forced calls take Kimi's ids, counted on from the conversation's earlier calls."""
    out = ChoiceOutput(None, None, forced="required", kimi_first=2)
    got = _stream(out, REQUIRED, 4)
    assert [v["id"] for v in got["tool_calls"].values()] == ["functions.get_weather:2", "functions.add:3"]
    named = ChoiceOutput(None, None, forced="get_weather", kimi_first=0)
    named.text = NAMED_ARGS
    assert named.message()["tool_calls"][0]["id"] == "functions.get_weather:0"
    plain = ChoiceOutput(None, None, forced="get_weather")
    plain.text = NAMED_ARGS
    assert plain.message()["tool_calls"][0]["id"].startswith("chatcmpl-tool-")


def test_forced_tool_choice_unfinished_and_malformed():
    """A forced call cut short (length, a stop string) keeps what was streamed of it and the engine's finish_reason;
    output that never began a call is the raw text as content."""
    cut = REQUIRED[: REQUIRED.index('"a": 1') + 6]
    for streamed in (False, True):
        out = ChoiceOutput(None, None, forced="required")
        if streamed:
            got = _stream(out, cut, 2)
            calls = [(v["name"], v["arguments"]) for v in got["tool_calls"].values()]
        else:
            out.text = cut
            m = out.message()
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            assert m["content"] is None
        assert calls == [("get_weather", '{"city": "Rome", "x": {"y": [true, null]}}'), ("add", '{"a": 1')]
        assert out.finish_reason("length") == "length"
    named = ChoiceOutput(None, None, forced="get_weather")
    named.text = '{"city": "Pa'
    m = named.message()
    assert m["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa' and named.finish_reason("length") == "length"
    for forced in ("required", "get_weather"):
        bad = ChoiceOutput(None, None, forced=forced)
        bad.text = "not json"
        assert bad.message()["content"] == "not json" and bad.finish_reason("stop") == "stop"
        assert _stream(ChoiceOutput(None, None, forced=forced), "not json", 3)["content"] == "not json"


@pytest.mark.parametrize(
    "parser,end", [("deepseek_r1", "</think>"), ("kimi_k2", "</think>"), ("kimi_k2", "<|tool_calls_section_begin|>")]
)
def test_forced_call_after_reasoning(parser, end):
    """A reasoning parser and a forced call: the reasoning comes first as reasoning_content, then the JSON after its
    end (the engine's grammar holds from there) streams as the call's arguments; K2's tool-section marker ends the
    reasoning and is not part of the arguments."""
    text = "Weather, so\nget_weather." + end + NAMED_ARGS
    whole = ChoiceOutput(REASONING_PARSERS[parser](), None, forced="get_weather")
    whole.text = text
    msg = whole.message()
    assert msg["reasoning_content"] == "Weather, so\nget_weather." and msg["content"] is None
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == [NAMED_ARGS]
    got = _stream(ChoiceOutput(REASONING_PARSERS[parser](), None, forced="get_weather"), text, 1)
    assert got["reasoning_content"] == msg["reasoning_content"] and got["content"] == ""
    assert [(v["name"], v["arguments"]) for v in got["tool_calls"].values()] == [("get_weather", NAMED_ARGS)]
    # reasoning never ended: no call, all reasoning
    r = ChoiceOutput(REASONING_PARSERS[parser](), None, forced="get_weather")
    r.text = "still thinking"
    assert r.message() == {"role": "assistant", "content": None, "reasoning_content": "still thinking"}
    assert r.finish_reason("length") == "length"
