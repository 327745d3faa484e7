"""Structured output in the engine: each greedy token is the model's arg-max over exactly the tokens a fresh
xgrammar matcher allows after the tokens before it (one reference forward over the whole output); sampled and
batched requests match their grammar too, beside plain requests in the same steps (the overlapped loop stepping
aside for them); invalid grammars are refused naming the field. Under speculative decoding (REPLAY, NGRAM) greedy
structured outputs equal plain decoding's, with exactly the acceptance REPLAY's misses imply, and sampled ones follow
their grammar."""

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


def test_invalid_grammar_says_why(engine):
    # the message after the field and the kind is xgrammar's reason, without its C++ source location
    with pytest.raises(ValueError) as e:
        engine.grammars.compile(StructuredOutput("regex", "[a-", field="guided_regex"))
    reason = str(e.value).split("invalid regular expression: ", 1)[1]
    assert reason and reason not in ("None", "NoneType") and not reason.startswith("[")


def test_no_tokenizer_is_refused_naming_the_field(engine):
    from mlaserve.engine.grammar import GrammarCompiler

    c = GrammarCompiler(None, engine.model_config.vocab_size, [])
    with pytest.raises(ValueError, match="guided_regex: structured output needs a tokenizer; this model has none"):
        c.compile(StructuredOutput("regex", "a+", field="guided_regex"))


def test_without_xgrammar_the_request_is_refused_naming_the_field(engine, monkeypatch):
    from mlaserve.engine import grammar

    def missing(self):
        raise ImportError("No module named 'xgrammar'")

    monkeypatch.setattr(grammar.GrammarCompiler, "_build", missing)
    c = grammar.GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, [])
    with pytest.raises(ValueError, match="response_format: structured output needs the xgrammar package .No module"):
        c.compile(StructuredOutput("json_object", field="response_format"))


def test_padded_vocabulary_ids_are_never_allowed(engine):
    # a model whose lm_head has more rows than its tokenizer has tokens: those ids spell nothing, so no grammar
    # allows them (a regex over any capital letters, the ids' stand-in spelling a mutant would give, included)
    from mlaserve.engine.grammar import GrammarCompiler

    V = engine.model_config.vocab_size
    c = GrammarCompiler(engine.tokenizer, V + 64, sorted(engine.eos_token_ids))
    m = xgr.GrammarMatcher(c.compile(StructuredOutput("regex", "[A-Z]+")))
    bm = torch.zeros(1, (V + 64 + 31) // 32, dtype=torch.int32)
    m.fill_next_token_bitmask(bm, 0)
    allowed = allowed_tokens(bm, V + 64)[0]
    assert allowed[:V].any() and not allowed[V:].any()


def test_choices_beyond_ascii(engine):
    tok = engine.tokenizer
    m = xgr.GrammarMatcher(engine.grammars.compile(StructuredOutput("choice", choices=("café", "naïve"))))
    for t in tok.encode("café", add_special_tokens=False):
        assert m.accept_token(t)
    assert m.accept_token(sorted(engine.eos_token_ids)[0]) and m.is_terminated()


def test_json_object_is_compact(engine):
    # json_object, as json schemas: no runs of blank space (a space right after "{" is refused)
    tok = engine.tokenizer
    brace, space = (tok.encode(t, add_special_tokens=False) for t in ("{", " "))
    assert len(brace) == 1 and len(space) == 1
    m = xgr.GrammarMatcher(engine.grammars.compile(StructuredOutput("json_object")))
    assert m.accept_token(brace[0]) and not m.accept_token(space[0])


def test_compiled_grammars_are_kept_least_recently_used_first_out(engine, monkeypatch):
    from mlaserve.engine import grammar

    monkeypatch.setattr(grammar, "CACHE_SIZE", 2)
    c = grammar.GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, sorted(engine.eos_token_ids))
    a, b, d = (StructuredOutput("regex", r) for r in ("a+", "b+", "d+"))
    ga, gb = c.compile(a), c.compile(b)
    assert c.compile(a) is ga  # a used last: b is the oldest
    c.compile(d)
    assert len(c._cache) == 2 and c.compile(a) is ga and c.compile(b) is not gb


def test_bad_shapes():
    with pytest.raises(ValueError, match="guided_choice: the choices"):
        StructuredOutput("choice", choices=(), field="guided_choice")
    with pytest.raises(ValueError, match="structured_outputs: unknown kind"):
        StructuredOutput("xml", "x")


def test_fill_chain_is_the_mask_after_each_prefix(engine):
    """GrammarState.fill_chain: row i the mask a matcher fed the first i tokens gives, in one pass, the matcher left
    as it was; every row from a token the grammar refuses, or after the grammar ended, allows everything; and
    GrammarAhead's rows are those masks, a row past the drafts the last."""
    from mlaserve.engine.grammar import GrammarAhead

    so = StructuredOutput("regex", r"(ab|cd)+e")
    tok = engine.tokenizer
    ids = [tok.encode(c, add_special_tokens=False) for c in "abcde"]
    assert all(len(i) == 1 for i in ids)
    a, b, c, d, e = (i[0] for i in ids)
    st = engine.grammars.state(so)
    V = engine.model_config.vocab_size
    W = (V + 31) // 32

    def fresh(tokens):
        m = xgr.GrammarMatcher(engine.grammars.compile(so))
        for t in tokens:
            assert m.accept_token(t)
        bm = torch.empty(1, W, dtype=torch.int32)
        m.fill_next_token_bitmask(bm, 0)
        return bm[0]

    assert st.accept(a)
    masks = torch.zeros(4, W, dtype=torch.int32)
    st.fill_chain(masks, [b, c, d])
    for i, more in enumerate([[], [b], [b, c], [b, c, d]]):
        assert torch.equal(masks[i], fresh([a] + more)), more
    masks = torch.zeros(4, W, dtype=torch.int32)
    st.fill_chain(masks, [b, a, a])  # "a" is fine after "ab", "aa" is not: rows 0-2 masks, row 3 everything
    assert torch.equal(masks[2], fresh([a, b, a])) and (masks[3] == -1).all()
    stop = engine.grammars.stop_ids[0]
    masks = torch.zeros(5, W, dtype=torch.int32)
    st.fill_chain(masks, [b, e, stop, a])  # the grammar ends with the stop token: every row after it all allowed
    assert torch.equal(masks[2], fresh([a, b, e]))
    assert (masks[3] == -1).all() and (masks[4] == -1).all()
    # free until token `d` (after_token_ids): rows up to it allow everything, then the grammar from its start
    free = engine.grammars.state(StructuredOutput("regex", r"(ab|cd)+e", after_token_ids=(d,)))
    bm = torch.zeros(1, W, dtype=torch.int32)
    free.fill_bitmask(bm, 0)
    assert (bm[0] == -1).all()
    masks = torch.zeros(5, W, dtype=torch.int32)
    free.fill_chain(masks, [e, d, c, d])
    assert (masks[0] == -1).all() and (masks[1] == -1).all()
    assert torch.equal(masks[2], fresh([])) and torch.equal(masks[3], fresh([c]))
    assert torch.equal(masks[4], fresh([c, d]))
    assert free.waiting == frozenset((d,))  # the chain left the state as it was
    ahead = GrammarAhead(st, [b, c])
    bm = torch.zeros(4, W, dtype=torch.int32)
    for row, i in enumerate([0, 1, 2, 3]):
        ahead.row(i).fill_bitmask(bm, row)
    assert torch.equal(bm[0], fresh([a])) and torch.equal(bm[2], fresh([a, b, c])) and torch.equal(bm[3], bm[2])
    one = torch.zeros(1, W, dtype=torch.int32)
    st.fill_chain(one, [])
    assert torch.equal(one[0], fresh([a]))  # unchanged by the fills
    assert st.accept(b) and st.accept(e) and not st.accept(a)


def _structured_workload(engine):
    """Greedy requests under each kind of grammar (each its own prompt: REPLAY keys its recordings by prompt), one
    free until its end-of-reasoning token, and a plain one."""
    kinds = [
        StructuredOutput("json", json.dumps(SCHEMA)),
        StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}"),
        StructuredOutput("choice", choices=("yes", "no", "maybe")),
        StructuredOutput("grammar", 'root ::= "a" ("b" | "c") ("b" | "c") "d"'),
        StructuredOutput("regex", r"(ab|cd)+e"),
    ]
    g = dict(temperature=0, max_tokens=40)
    params = [SamplingParams(**g, structured=so) for so in kinds]
    end = 290 if 290 not in engine.eos_token_ids else 291
    after = StructuredOutput("json", json.dumps(SCHEMA), after_token_ids=(end,))
    params.append(SamplingParams(**g, logit_bias={end: 100.0}, structured=after))  # the grammar holds from token 1
    params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    return [PROMPT + [50 + i] for i in range(len(params))], params


@pytest.mark.parametrize("how", ["replay-full", "replay-0.3", "ngram"])
def test_speculative_structured_output_equals_plain(tiny_ckpt, tmp_path, how):
    """Speculative decoding with structured output (EAGLE3's, NGRAM's, REPLAY's verify): verify row i of a grammar
    request is masked after the request's first i drafts, so greedy outputs equal plain decoding's; with REPLAY
    proposing plain's outputs, each request's acceptance per position is exactly what its misses imply (a mask
    behind the drafts would refuse a recorded token and miss, or emit a wrong one)."""
    from tests.engine.conftest import run_requests
    from tests.spec.test_replay import expected_per_position

    plain_eng = make_engine(tiny_ckpt, num_pages=128, page_size=16)
    prompts, params = _structured_workload(plain_eng)
    plain = run_requests(plain_eng, prompts, params)
    for out in plain[:-1]:
        assert out[-1] in plain_eng.eos_token_ids, out  # every grammar finished
    k = 3
    if how == "ngram":
        spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=k, prompt_lookup_min=1, prompt_lookup_max=3))
    else:
        path = str(tmp_path / "rec.jsonl")
        write_recordings(path, zip(prompts, plain))
        rate = 0.0 if how == "replay-full" else 0.3
        spec = SpecConfig.from_dict(
            dict(algorithm="REPLAY", num_steps=k, replay_path=path, replay_miss_rate=rate, replay_seed=3)
        )
    eng = make_engine(tiny_ckpt, spec=spec, num_pages=128, page_size=16)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs, last = {r: [] for r in rids}, {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
            last[o.request_id] = o
    assert [outs[r] for r in rids] == plain
    if how != "ngram":
        got = [list(last[r].usage.spec_accepted_per_position) for r in rids]
        want = [expected_per_position(p, k, rate, 3, max_tokens=len(o)) for p, o in zip(prompts, plain)]
        assert got == want and sum(map(sum, want)) > 0
    assert eng.pool.num_free == eng.pool.num_pages


def test_speculative_sampled_structured_output_follows_the_grammar(tiny_ckpt):
    """Sampled structured requests on an NGRAM engine (the speculative-sampling rule over masked verify rows) beside
    greedy plain ones: every output follows its grammar, and the plain requests keep overlapping."""
    spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=3, prompt_lookup_min=1, prompt_lookup_max=3))
    eng = make_engine(tiny_ckpt, spec=spec, num_pages=128, page_size=16)
    checks = {
        "json": (StructuredOutput("json", json.dumps(SCHEMA)), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        "regex": (StructuredOutput("regex", r"(ab|cd)+e"), lambda t: re.fullmatch(r"(ab|cd)+e", t) or 1 / 0),
        "choice": (
            StructuredOutput("choice", choices=("yes", "no", "maybe")),
            lambda t: t in ("yes", "no", "maybe") or 1 / 0,
        ),
    }
    rids = {}
    for seed in (1, 2, 3):
        for name, (so, _) in checks.items():
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured=so)
            rids[eng.add_request(PROMPT + [seed], sp)] = name
    plain = eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    outs = run_all(eng)
    for rid, name in rids.items():
        assert outs[rid][-1] in eng.eos_token_ids, (name, outs[rid])
        checks[name][1](text_of(eng, outs[rid]))
    assert len(outs[plain]) == 40 and eng.stats()["spec_steps"] > 0
