"""Structured output in the engine: each greedy token is the model's arg-max over exactly the tokens a fresh
xgrammar matcher allows after the tokens before it (one reference forward over the whole output); sampled and
batched requests match their grammar too, beside plain requests in the same steps (the overlapped loop stepping
aside for them); invalid grammars and speculative decoding are refused naming the field."""

from __future__ import annotations

import json
import re

import pytest
import torch

from mlaserve.config import SpecConfig
from mlaserve.layers.grammar_mask import allowed_tokens
from mlaserve.spec.replay import write_recordings
from mlaserve.types import SamplingParams, StructuredOutput
from tests.helpers.ref_sampling import model_logits

from .conftest import make_engine, run_all

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
}
PROMPT = [40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt, num_pages=128, page_size=16)


def text_of(engine, ids):
    return engine.tokenizer.decode([t for t in ids if t not in engine.eos_token_ids])


def test_greedy_is_the_masked_argmax(engine):
    so = StructuredOutput("json", json.dumps(SCHEMA), field="response_format")
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40, structured=so))
    out = run_all(engine)[rid]
    assert out[-1] in engine.eos_token_ids  # the grammar finished and took EOS
    jsonschema.validate(json.loads(text_of(engine, out)), SCHEMA)
    logits = model_logits(engine, PROMPT + out[:-1])[len(PROMPT) - 1 :]  # [len(out), V]
    matcher = xgr.GrammarMatcher(engine.grammars.compile(so))
    V = logits.shape[1]
    bm = torch.empty(1, (V + 31) // 32, dtype=torch.int32)
    for i, t in enumerate(out):
        matcher.fill_next_token_bitmask(bm, 0)
        allowed = allowed_tokens(bm, V)[0]
        assert int(logits[i].masked_fill(~allowed, float("-inf")).argmax()) == t, f"token {i}"
        assert matcher.accept_token(t)
    assert matcher.is_terminated()


def test_kinds_sampled_and_batched_with_plain_requests(engine):
    kinds = {
        "json": StructuredOutput("json", json.dumps(SCHEMA)),
        "regex": StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}"),
        "choice": StructuredOutput("choice", choices=("yes", "no", "maybe")),
        "object": StructuredOutput("json_object"),
        "ebnf": StructuredOutput("grammar", 'root ::= "a" ("b" | "c") ("b" | "c") "d"'),
        "lark": StructuredOutput("grammar", 'start: "x" ("y" | "z") "!"'),
    }
    rids = {}
    for seed in (1, 2):
        for name, so in kinds.items():
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured=so)
            rids[engine.add_request(PROMPT, sp)] = name
        rids[engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))] = "plain"
    outs = run_all(engine)
    for rid, name in rids.items():
        text = text_of(engine, outs[rid])
        if name == "plain":
            assert len(outs[rid]) == 12
        elif name == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif name == "object":  # free keys and values can outlast max_tokens on a random model
            assert text.startswith("{"), text
            if outs[rid][-1] in engine.eos_token_ids:
                assert isinstance(json.loads(text), dict), text
        elif name == "regex":
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
        elif name == "choice":
            assert text in ("yes", "no", "maybe")
        elif name == "ebnf":
            assert re.fullmatch(r"a[bc][bc]d", text), text
        else:
            assert re.fullmatch(r"x[yz]!", text), text


def test_n_choices_each_follow_the_grammar(engine):
    so = StructuredOutput("regex", r"(ab|cd)+e")
    rid = engine.add_request(PROMPT, SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=30, structured=so))
    by_index: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                by_index.setdefault(o.index, []).extend(o.new_token_ids)
    assert sorted(by_index) == [0, 1, 2]
    for ids in by_index.values():
        text = text_of(engine, ids)
        assert re.fullmatch(r"(ab|cd)+e", text) or len(ids) == 30, text


def test_grammar_holds_after_the_end_of_reasoning(engine):
    """after_token_ids (a forced tool call on a thinking model): the output is free until the end-of-reasoning token,
    then each greedy token is the masked arg-max of a matcher started after it."""
    plain = run_all_one(engine, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    end = next(t for t in range(258, 300) if t not in plain and t not in engine.eos_token_ids)
    so = StructuredOutput("json", json.dumps(SCHEMA), field="tool_choice", after_token_ids=(end,))
    # never ended: no token is masked, the output is the plain greedy one
    assert run_all_one(engine, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, structured=so)) == plain
    # ended at the first token (biased there): the JSON follows under the grammar
    out = run_all_one(engine, SamplingParams(temperature=0, max_tokens=40, logit_bias={end: 100.0}, structured=so))
    assert out[0] == end and out[-1] in engine.eos_token_ids
    jsonschema.validate(json.loads(text_of(engine, out[1:])), SCHEMA)
    logits = model_logits(engine, PROMPT + out[:-1])[len(PROMPT) :].clone()  # [len(out) - 1, V]: after `end`
    logits[:, end] += 100.0
    matcher = xgr.GrammarMatcher(engine.grammars.compile(so))
    V = logits.shape[1]
    bm = torch.empty(1, (V + 31) // 32, dtype=torch.int32)
    for i, t in enumerate(out[1:]):
        matcher.fill_next_token_bitmask(bm, 0)
        assert int(logits[i].masked_fill(~allowed_tokens(bm, V)[0], float("-inf")).argmax()) == t, f"token {i}"
        assert matcher.accept_token(t)
    assert matcher.is_terminated()
    with pytest.raises(ValueError, match="tool_choice: after_token_ids"):
        StructuredOutput("json", "{}", field="tool_choice", after_token_ids=[end])


def run_all_one(engine, sp: SamplingParams) -> list[int]:
    rid = engine.add_request(PROMPT, sp)
    return run_all(engine)[rid]


@pytest.mark.parametrize(
    "so,match",
    [
        (StructuredOutput("json", '{"type": "foo"}', field="guided_json"), "guided_json: invalid JSON schema"),
        (StructuredOutput("json", "{nope", field="response_format"), "response_format: the JSON schema is not"),
        (StructuredOutput("regex", "[a-", field="guided_regex"), "guided_regex: invalid regular expression"),
        (StructuredOutput("grammar", "root ::= (", field="guided_grammar"), "guided_grammar: invalid grammar"),
    ],
)
def test_invalid_is_refused_naming_the_field(engine, so, match):
    with pytest.raises(ValueError, match=re.escape(match)) as e:
        engine.add_request(PROMPT, SamplingParams(max_tokens=4, structured=so))
    assert ".cc" not in str(e.value) and "/" not in str(e.value).split(":", 1)[1][:40]
    assert not engine.has_unfinished()


def test_bad_shapes():
    with pytest.raises(ValueError, match="guided_choice: the choices"):
        StructuredOutput("choice", choices=(), field="guided_choice")
    with pytest.raises(ValueError, match="structured_outputs: unknown kind"):
        StructuredOutput("xml", "x")


def test_speculative_decoding_refuses_structured_output(tiny_ckpt, tmp_path):
    path = str(tmp_path / "rec.jsonl")
    write_recordings(path, [([1, 2, 3], [4, 5])])
    spec = SpecConfig.from_dict({"algorithm": "REPLAY", "num_steps": 2, "replay_path": path})
    eng = make_engine(tiny_ckpt, spec=spec, num_pages=64, page_size=16)
    # tool_choice: the forced tool call's schema (server/chat_tools.py) is refused under its own field's name
    for field in ("response_format", "tool_choice"):
        so = StructuredOutput("regex", "[a-z]+", field=field)
        with pytest.raises(ValueError, match=f"{field}: not supported together with speculative decoding"):
            eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=4, structured=so))
