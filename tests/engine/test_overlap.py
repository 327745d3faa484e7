"""Overlapped decode (engine/loop.py): the next decode step launches before the current one is read back, its input
ids copied on the device. Every request's events (tokens, text, finish and stop reasons, logprobs) must equal
the plain loop's, for requests that end by length, stop token, stop string and abort, with arrivals mid-run;
no KV page may leak (the conftest checks the pool)."""

import random

import pytest

from mlaserve.tokenizer import Tokenizer
from mlaserve.types import SamplingParams

from ..helpers.engine_drive import drive, summary
from .conftest import make_engine


def _workload(tiny_ckpt):
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    tok = Tokenizer.from_pretrained(tiny_ckpt)
    probe = make_engine(tiny_ckpt)
    rid = probe.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    evs = []
    while probe.has_unfinished():
        evs += [e for e in probe.step() if e.request_id == rid]
    greedy = [t for e in evs for t in e.new_token_ids]
    text = tok.decode(greedy)
    stop = next(
        (
            text[i : i + 2]
            for i in range(len(text) // 2, len(text) - 2)
            if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
        ),
        None,
    )
    g = dict(temperature=0, ignore_eos=True)
    arrivals = {
        0: [
            ("len", prompts[0], SamplingParams(max_tokens=17, **g)),
            ("stop_tok", prompts[0], SamplingParams(max_tokens=30, stop_token_ids=[greedy[6]], **g)),
            ("seeded", prompts[1], SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=25, ignore_eos=True)),
            ("logprobs", prompts[2], SamplingParams(max_tokens=12, logprobs=0, **g)),
        ],
        4: [("late", prompts[3], SamplingParams(max_tokens=9, **g))],
        9: [
            ("aborted", prompts[4], SamplingParams(max_tokens=40, **g)),
            ("late2", prompts[5], SamplingParams(max_tokens=15, **g)),
        ],
    }
    if stop:
        arrivals[0].append(("stop_str", prompts[0], SamplingParams(max_tokens=30, stop=[stop], **g)))
    return arrivals, {14: ["aborted"]}


@pytest.mark.parametrize("page_size", [16, 4])
def test_overlapped_decode_equals_plain_loop(tiny_ckpt, page_size):
    arrivals, aborts = _workload(tiny_ckpt)
    runs = []
    for overlap in (False, True):
        engine = make_engine(tiny_ckpt, page_size=page_size, max_num_seqs=8, disable_overlap_schedule=not overlap)
        runs.append((drive(engine, arrivals, aborts), engine.stats()["overlapped_steps"]))
    (plain, n_plain), (over, n_over) = runs
    assert n_plain == 0 and n_over > 10, (n_plain, n_over)
    assert plain.keys() == over.keys()
    for key in plain:
        a, b = summary(plain[key]), summary(over[key])
        if key == "aborted":  # overlapped, admissions wait for the launched step: the abort lands earlier in it
            assert b[0] == a[0][: len(b[0])] and not a[2] and not b[2], (a, b)
            continue
        assert a == b, f"{key}: plain {a} vs overlapped {b}"
        if key == "logprobs":
            la = [x for e in plain[key] for x in e.new_logprobs]
            lb = [x for e in over[key] for x in e.new_logprobs]
            assert la == pytest.approx(lb, abs=1e-4)
    assert over["stop_tok"][-1].finish_reason == "stop" and over["len"][-1].finish_reason == "length"
    assert over["stop_str"][-1].finish_reason == "stop" and isinstance(over["stop_str"][-1].stop_reason, str)


def test_overlap_survives_abort_of_everything_in_flight(tiny_ckpt):
    engine = make_engine(tiny_ckpt, page_size=4)
    rids = [
        engine.add_request([1, 2, 3, 4 + i], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        for i in range(3)
    ]
    for _ in range(5):
        engine.step()
    assert engine.stats()["overlapped_steps"] > 0 and engine.loop.inflight is not None
    for r in rids:
        assert engine.abort_request(r)
    assert engine.has_unfinished()  # the launched step still has to be read back
    assert engine.step() == [] and not engine.has_unfinished()
    rid = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    toks = []
    while engine.has_unfinished():
        toks += [t for o in engine.step() for t in o.new_token_ids]
    assert len(toks) == 6 and rid


def test_overlap_stays_on_while_requests_end_by_length(tiny_ckpt):
    """Requests that reach max_tokens sit the next launched step out instead of stopping the overlap."""
    outs = []
    for disable in (True, False):
        engine = make_engine(tiny_ckpt, page_size=4, disable_overlap_schedule=disable)
        rids = [
            engine.add_request([1, 2, 3 + i], SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True))
            for i in range(4)
        ]
        got = {r: [] for r in rids}
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
        outs.append([got[r] for r in rids])
    assert outs[0] == outs[1] and [len(t) for t in outs[1]] == [5, 8, 11, 14]
    stats = engine.stats()
    assert stats["overlapped_steps"] == stats["steps"] - 1, stats  # all but the prefill
