"""Overlapped verify steps (engine/spec_loop.py, launch_next): while a greedy decode-only verify is in flight, the
next one is launched from its device outputs, its positions moved on the device by the accepted counts. Outputs
must be plain greedy's token for token (EAGLE3, K = 1..3, several batch sizes; a device oracle draft that accepts
several tokens a step, so requests end by EOS, stop string, stop token and length inside a step), with arrivals and
aborts while a step is in flight; no KV page may leak (the conftest checks the pool). The overlapped steps are
counted, so a silent fall-back to the serial loop fails here."""

import pytest
import torch

from mlaserve.attention.base import ForwardBatch, SeqChunk
from mlaserve.config import SpecConfig
from mlaserve.tokenizer import Tokenizer
from mlaserve.types import SamplingParams
from tests.helpers.engine_drive import assert_same_events, drive, ending_mid_step, stop_string_in, summary
from tests.helpers.oracle_draft import install_oracle

from .conftest import make_engine, run_requests
from .test_spec_device_path import GREEDY, MAX, _prompts, draft, plain  # noqa: F401 (fixtures)


def _run(eng, prompts, params=None):
    """-> each request's tokens; params: one a prompt (default greedy)."""
    return run_requests(eng, prompts, params or [GREEDY] * len(prompts))


def _engine(ckpt, draft_dir, k, overlap=True, **kw):
    kw.setdefault("max_num_seqs", 8)
    spec = SpecConfig(draft_model=draft_dir, num_steps=k)
    return make_engine(ckpt, spec=spec, page_size=4, disable_overlap_schedule=not overlap, **kw)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_overlapped_eagle3_equals_plain(tiny_ckpt, draft, plain, k, batch):  # noqa: F811
    eng = _engine(tiny_ckpt, draft, k)
    assert _run(eng, _prompts(batch)) == plain[:batch]
    st = eng.stats()
    assert st["overlapped_steps"] > 0 and st["spec_device_steps"] == eng.loop.decode_only_steps, st


@pytest.mark.parametrize("k", [1, 2, 3])
def test_oracle_overlapped_equals_serial_and_plain(tiny_ckpt, draft, plain, k):  # noqa: F811
    """Several tokens accepted a step: the overlapped loop gives plain greedy's outputs, and its EAGLE3 draft (run
    from device-moved starts) drafts what the serial loop's (disable_overlap_schedule) does at each position and
    accepted count."""
    prompts = _prompts(8)
    drafted = {}
    for overlap in (True, False):
        eng = _engine(tiny_ckpt, draft, k, overlap)
        oracle = install_oracle(eng, prompts, plain)
        log = drafted[overlap] = {}
        inner = oracle.inner.propose_verified

        def logged(y, acc, hidden, reqs, starts=None, shift=None, f=inner, lg=log):
            d = f(y, acc, hidden, reqs, starts, shift)
            s = [r.num_computed_tokens for r in reqs] if starts is None else starts
            s = (torch.tensor(s) + (0 if shift is None else shift)).tolist()  # a read back: CPU only
            for r, x, a, row in zip(reqs, s, acc.tolist(), d.tolist()):
                lg[(tuple(r.prompt_token_ids), x, a)] = row
            return d

        oracle.inner.propose_verified = logged
        assert _run(eng, prompts) == plain
        st = eng.stats()
        assert (st["overlapped_steps"] > 0) == overlap and st["spec_device_steps"] == eng.loop.decode_only_steps
        assert st["spec_accepted_tokens"] > st["spec_steps"] // 2, st  # most steps accept drafts
    # the overlapped loop also drafted for requests its step in flight then ended (their tokens dropped)
    assert drafted[False] and {x: drafted[True].get(x) for x in drafted[False]} == drafted[False]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_overlapped_requests_ending_mid_step_and_arriving(tiny_ckpt, draft, plain, k):  # noqa: F811
    """EOS, stop token, stop string and length inside a verify's accepted tokens; arrivals and an abort while a
    step is in flight."""
    prompts = _prompts(8)
    g0 = plain[0]
    stop = stop_string_in(Tokenizer.from_pretrained(tiny_ckpt).decode(g0))
    g = dict(temperature=0, ignore_eos=True)
    arrivals = ending_mid_step(prompts, g0, MAX, GREEDY)
    arrivals[9] = [("late3", prompts[6], SamplingParams(max_tokens=13, **g))]
    if stop:
        arrivals[0].append(("stop_str", prompts[0], SamplingParams(max_tokens=MAX, stop=[stop], **g)))
    aborts = {8: ["aborted"]}
    runs, inflight_aborts = {}, []
    for mode in ("plain", "spec"):
        spec = SpecConfig(draft_model=draft, num_steps=k) if mode == "spec" else None
        eng = make_engine(tiny_ckpt, spec=spec, page_size=4, max_num_seqs=8)
        if mode == "spec":
            install_oracle(eng, prompts, plain)
            abort = eng.abort_request
            eng.abort_request = lambda rid, e=eng, a=abort: inflight_aborts.append(e.loop.pending) or a(rid)
        eng.eos_token_ids = frozenset({plain[1][5]})  # "eos" ends at its 6th token
        runs[mode] = drive(eng, arrivals, aborts)
        if mode == "spec":
            st = eng.stats()
            assert st["overlapped_steps"] > 0 and st["spec_device_steps"] > 0, st
    assert inflight_aborts == [True]  # the abort came while a step was in flight
    assert_same_events(runs["plain"], runs["spec"], "speculative")
    spec = runs["spec"]
    assert spec["eos"][-1].finish_reason == "stop" and len(summary(spec["eos"])[0]) == 6
    assert spec["len"][-1].finish_reason == "length" and spec["stop_tok"][-1].stop_reason == g0[6]
    assert any(len(e.new_token_ids) > 1 for e in spec["full"])  # verify steps emitted several tokens


@pytest.mark.parametrize("k", [1, 3])
def test_overlapped_verify_through_static_buffers(tiny_ckpt, draft, plain, k):  # noqa: F811
    """The verify's graph runner (run eagerly, use_graphs=False) moves its static positions, lengths and slots
    by the accepted counts on the device."""
    prompts = _prompts(3)
    eng = _engine(tiny_ckpt, draft, k, max_num_seqs=4)
    eng.runner.capture_graphs(k + 1, eng.max_model_len, use_graphs=False)
    install_oracle(eng, prompts, plain)
    shifted = []
    run = eng.runner.graphs.run
    eng.runner.graphs.run = lambda key, d, p, t=None, s=None: shifted.append(s is not None) or run(key, d, p, t, s)
    assert _run(eng, prompts) == plain[:3]
    assert any(shifted) and eng.stats()["overlapped_steps"] > 0


def test_shift_decode_equals_a_batch_built_there():
    """ForwardBatch.shift_decode: positions, lengths, host mirrors and KV slots as if built at the shifted starts."""
    ps, q = 4, 3
    pages = [[7, 2, 9, 4], [3, 8, 1, 6], [5, 0, 11, 10]]
    starts, shift = [1, 5, 2], [3, 0, 6]

    def build(s):
        return ForwardBatch.build([SeqChunk([0] * q, x, p, "all") for x, p in zip(s, pages)], [], ps, "cpu")

    got, want = build(starts), build([a + b for a, b in zip(starts, shift)])
    got.shift_decode(torch.tensor(shift), ps)
    for f in ("positions", "slot_mapping", "seq_lens"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert got.seq_lens_cpu == want.seq_lens_cpu


@pytest.mark.parametrize("k", [1, 3])
def test_sampled_top_k_1_overlapped_equals_plain_greedy(tiny_ckpt, draft, plain, k):  # noqa: F811
    """Sampled requests verify on the device too (the speculative-sampling rule, batched) and overlap like greedy
    ones. With top_k = 1 a request's distribution is its arg-max, so every draft equal to it is accepted and a
    rejection emits the arg-max: plain greedy's tokens, beside greedy requests in the same steps. The oracle draft
    accepts several tokens a step (the all-accepted bonus draw), with overlap on and off."""
    prompts = _prompts(8)
    top1 = SamplingParams(temperature=0.7, top_k=1, max_tokens=MAX, ignore_eos=True)
    params = [top1 if i % 2 == 0 else GREEDY for i in range(8)]
    for overlap, oracle in ((True, False), (True, True), (False, True)):
        eng = _engine(tiny_ckpt, draft, k, overlap)
        if oracle:
            install_oracle(eng, prompts, plain)
        assert _run(eng, prompts, params) == plain
        st = eng.stats()
        assert (st["overlapped_steps"] > 0) == overlap, st
        assert st["spec_device_steps"] == eng.loop.decode_only_steps > 0, st
        if oracle:
            assert st["spec_accepted_tokens"] > st["spec_steps"] // 2, st


def test_seeded_sampled_requests_overlapped_equal_serial_and_alone(tiny_ckpt, draft):  # noqa: F811
    """Seeded sampled requests (temperature, top_p) draw only from their own generators, the same count every
    verify step, so the overlapped loop gives the serial loop's tokens and a request alone its tokens in the batch."""
    prompts = _prompts(6)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=10 + i, max_tokens=MAX, ignore_eos=True) for i in range(6)
    ]
    outs = {}
    for overlap in (True, False):
        eng = _engine(tiny_ckpt, draft, 2, overlap)
        outs[overlap] = _run(eng, prompts, params)
        st = eng.stats()
        assert (st["overlapped_steps"] > 0) == overlap and st["spec_device_steps"] > 0, st
    assert outs[True] == outs[False] and all(len(t) == MAX for t in outs[True])
    eng = _engine(tiny_ckpt, draft, 2)
    assert _run(eng, prompts[2:3], params[2:3]) == outs[True][2:3]
    greedy = make_engine(tiny_ckpt, page_size=4)
    assert _run(greedy, prompts, [GREEDY] * 6) != outs[True]  # it sampled
