"""The speculative step on the device (engine/spec_loop.py): a decode-only verify of greedy requests accepts and
drafts from its device outputs and is read back once. Its outputs must be plain greedy's token for token (EAGLE3 and
REPLAY drafts, K = 1..3, several batch sizes), its acceptance exactly what REPLAY's misses imply, and every event
(tokens, text, finish and stop reasons) the plain engine's for requests ending by EOS, length and stop string,
arriving and leaving mid-run; no KV page may leak (the conftest checks the pool). Each step's path is counted, so a
regression to the host path fails here."""

import random

import pytest

from mlaserve.config import SpecConfig
from mlaserve.engine import spec_loop
from mlaserve.models.make_random_draft import make_random_draft
from mlaserve.spec.replay import write_recordings
from mlaserve.tokenizer import Tokenizer
from mlaserve.types import SamplingParams

from ..helpers.engine_drive import assert_same_events, drive, ending_mid_step, stop_string_in, summary
from ..spec.test_replay import expected_per_position
from .conftest import make_engine, run_requests

MAX = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(1, 50))] for _ in range(n)]


@pytest.fixture(scope="module")
def draft(tiny_ckpt, tmp_path_factory):
    return make_random_draft("tiny-eagle3", str(tmp_path_factory.mktemp("d")), target=tiny_ckpt, dtype="float32")


@pytest.fixture(scope="module")
def plain(tiny_ckpt):
    """Plain greedy outputs of the 8 prompts (batch-invariant on the CPU: a prefix of them is batch n's)."""
    return run_requests(make_engine(tiny_ckpt, page_size=4), _prompts(8), [GREEDY] * 8)


@pytest.fixture(scope="module")
def recording(plain, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rec") / "r.jsonl")
    write_recordings(path, zip(_prompts(8), plain))
    return path


def _run(eng, prompts, monkeypatch):
    """-> outputs; checks that every decode-only step took the device path with one read back."""
    reads = []
    real = spec_loop.queue_rows
    monkeypatch.setattr(spec_loop, "queue_rows", lambda parts: reads.append(len(parts)) or real(parts))
    verify_chunks = []
    propose = eng.proposer.propose
    eng.proposer.propose = lambda chunks: verify_chunks.extend(c for c in chunks if c.verify) or propose(chunks)
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    out = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    st = eng.stats()
    assert st["spec_device_steps"] == eng.loop.decode_only_steps == len(reads) > 0, st
    assert all(n == 3 for n in reads)  # (y, accepted, drafts) in one read
    assert not verify_chunks  # nothing drafted from the host after a verify
    return [out[r] for r in rids]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_eagle3_device_step_equals_plain(tiny_ckpt, draft, plain, monkeypatch, k, batch):
    eng = make_engine(tiny_ckpt, spec=SpecConfig(draft_model=draft, num_steps=k), page_size=4, max_num_seqs=8)
    assert _run(eng, _prompts(batch), monkeypatch) == plain[:batch]


@pytest.mark.parametrize("with_draft", [False, True], ids=["replay", "replay+draft"])
@pytest.mark.parametrize("k,rate", [(1, 0.0), (2, 0.5), (3, 0.5), (3, 0.0), (2, 1.0)])
def test_replay_device_step_exact_acceptance(tiny_ckpt, draft, plain, recording, monkeypatch, k, rate, with_draft):
    spec = SpecConfig.from_dict(
        dict(
            algorithm="REPLAY",
            num_steps=k,
            replay_path=recording,
            replay_miss_rate=rate,
            replay_seed=3,
            draft_model=draft if with_draft else None,
        )
    )
    eng = make_engine(tiny_ckpt, spec=spec, page_size=4, max_num_seqs=8)
    prompts = _prompts(8)
    assert _run(eng, prompts, monkeypatch) == plain  # without a draft model the device step drafts nothing
    want = [expected_per_position(p, k, rate, 3, max_tokens=MAX) for p in prompts]
    assert eng.stats()["spec_accepted_per_position"] == [sum(c[i] for c in want) for i in range(k)]
    assert all(t.recorded is not None for t in eng.proposer.tracks.values())  # no output left its recording


@pytest.mark.parametrize("k", [1, 3])
def test_requests_ending_mid_step_and_arriving(tiny_ckpt, draft, plain, recording, k):
    """EOS, stop token, stop string and length inside a verify's accepted tokens; arrivals and an abort mid-run.
    The REPLAY draft at full acceptance makes every step emit K + 1 tokens, so the stops fall inside a step."""
    prompts = _prompts(8)
    g0 = plain[0]
    stop = stop_string_in(Tokenizer.from_pretrained(tiny_ckpt).decode(g0))
    g = dict(temperature=0, ignore_eos=True)
    arrivals = ending_mid_step(prompts, g0, MAX, GREEDY)
    if stop:
        arrivals[0].append(("stop_str", prompts[0], SamplingParams(max_tokens=MAX, stop=[stop], **g)))
    aborts = {8: ["aborted"]}
    runs = {}
    for mode in ("plain", "spec"):
        spec = None
        if mode == "spec":
            spec = SpecConfig.from_dict(
                dict(algorithm="REPLAY", num_steps=k, replay_path=recording, replay_miss_rate=0.0, draft_model=draft)
            )
        eng = make_engine(tiny_ckpt, spec=spec, page_size=4, max_num_seqs=8, disable_overlap_schedule=True)
        eng.eos_token_ids = frozenset({plain[1][5]})  # "eos" ends at its 6th token
        runs[mode] = drive(eng, arrivals, aborts)
        if mode == "spec":
            assert eng.stats()["spec_device_steps"] > 0
    assert_same_events(runs["plain"], runs["spec"], "speculative")
    spec = runs["spec"]
    assert spec["eos"][-1].finish_reason == "stop" and len(summary(spec["eos"])[0]) == 6
    assert spec["len"][-1].finish_reason == "length" and spec["stop_tok"][-1].stop_reason == g0[6]
    assert any(len(e.new_token_ids) > 1 for e in spec["full"])  # verify steps emitted several tokens


@pytest.mark.parametrize("k", [1, 2])
def test_prompt_whose_last_chunk_is_one_token(tiny_ckpt, draft, k):
    """A prompt one token longer than the prefill chunk leaves a 1-token last chunk: it has no drafts yet, so it is
    prefilled (sampled), not verified; outputs equal plain greedy's under the same chunking."""
    prompts = [list(range(1, 18)), list(range(3, 36)), [7] * 16]
    plain = make_engine(tiny_ckpt, page_size=4, chunked_prefill_size=16)
    spec = make_engine(tiny_ckpt, spec=SpecConfig(draft_model=draft, num_steps=k), page_size=4, chunked_prefill_size=16)
    outs = []
    for eng in (plain, spec):
        rids = [eng.add_request(p, GREEDY) for p in prompts]
        out = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] += o.new_token_ids
        outs.append([out[r] for r in rids])
    assert outs[1] == outs[0]
    assert all(len(o) == MAX for o in outs[1])


def test_step_of_only_mid_prompt_chunks_runs_no_chain(tiny_ckpt, draft):
    """A long prompt alone, chunked: its first steps only extend the draft's KV (no position to propose at), so the
    K-step chain has no rows to run; the draft is never called on zero rows (the GPU's attention refuses them)."""
    spec = make_engine(tiny_ckpt, spec=SpecConfig(draft_model=draft, num_steps=2), page_size=4, chunked_prefill_size=16)
    rows = []
    fwd = spec.proposer.draft.forward
    spec.proposer.draft.forward = lambda ids, *a, **kw: rows.append(ids.shape[0]) or fwd(ids, *a, **kw)
    plain = make_engine(tiny_ckpt, page_size=4, chunked_prefill_size=16)
    prompt = list(range(1, 41))  # chunks of 16, 16, 8
    outs = []
    for eng in (plain, spec):
        rid = eng.add_request(prompt, GREEDY)
        out = []
        while eng.has_unfinished():
            out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
        outs.append(out)
    assert outs[1] == outs[0] and len(outs[0]) == MAX
    assert rows[:2] == [16, 16] and min(rows) > 0, rows
