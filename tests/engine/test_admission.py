"""Admission by the KV cache: a request the cache can never hold is refused naming the numbers, a small cache lowers
max_model_len (with a warning), a waiting request short of pages does not block later ones that fit (up to the
skip-ahead limit), and a request that outgrows the whole cache is finished by length, never recomputed forever."""

import logging

import pytest

from mlaserve.types import SamplingParams

from .conftest import make_engine, run_all

GREEDY = dict(temperature=0, ignore_eos=True)


def _events(engine, limit: int = 2000) -> list:
    evs = []
    for _ in range(limit):
        if not engine.has_unfinished():
            return evs
        evs += engine.step()
    raise AssertionError(f"the engine did not finish within {limit} steps")


def test_small_cache_lowers_max_model_len(tiny_ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="mlaserve.engine"):
        eng = make_engine(tiny_ckpt, page_size=16, num_pages=16, max_model_len=4096)
    assert eng.max_model_len == 256
    assert "max_model_len lowered from 4096 to 256" in caplog.text and "16 pages of 16" in caplog.text
    big = make_engine(tiny_ckpt, page_size=16, num_pages=512, max_model_len=300)
    assert big.max_model_len == 300


def test_request_larger_than_the_cache_is_refused(tiny_ckpt):
    eng = make_engine(tiny_ckpt, page_size=16, num_pages=16)
    with pytest.raises(ValueError) as e:
        eng.add_request([5, 6, 7], SamplingParams(max_tokens=300, **GREEDY))
    msg = str(e.value)
    assert msg.startswith("max_tokens: 300 plus the prompt's 3 tokens is 303")
    assert "max_model_len 256" in msg and "the KV cache holds 256 tokens (16 pages of 16)" in msg
    with pytest.raises(ValueError, match=r"prompt: 300 tokens .* KV cache holds 256"):
        eng.add_request([5] * 300, SamplingParams(max_tokens=1))
    assert not eng.has_unfinished()


def test_no_max_tokens_stops_at_the_cache(tiny_ckpt):
    eng = make_engine(tiny_ckpt, page_size=16, num_pages=16)
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=None, **GREEDY))
    evs = _events(eng)
    assert sum(len(e.new_token_ids) for e in evs if e.request_id == rid) == 256 - 3
    assert evs[-1].finished and evs[-1].finish_reason == "length"


def test_waiting_request_short_of_pages_does_not_block_others(tiny_ckpt):
    # 16 pages of 16: A holds 8 pages while it runs; B's 150-token prompt needs 10; C and D (4 tokens) need 1 each.
    eng = make_engine(tiny_ckpt, page_size=16, num_pages=16)
    a = eng.add_request([3] * 100, SamplingParams(max_tokens=20, **GREEDY))
    eng.step()
    b = eng.add_request([4] * 150, SamplingParams(max_tokens=4, **GREEDY))
    c = eng.add_request([5] * 4, SamplingParams(max_tokens=4, **GREEDY))
    d = eng.add_request([6] * 4, SamplingParams(max_tokens=4, **GREEDY))
    order, done = [], set()
    for e in _events(eng):
        if e.finished:
            order.append(e.request_id)
            done.add(e.request_id)
    assert order.index(c) < order.index(a) and order.index(d) < order.index(a), order
    assert set(order) == {a, b, c, d}
    assert eng.scheduler.bypassed == {}


def test_skip_ahead_is_bounded(tiny_ckpt):
    """After skip_ahead_limit later requests went past it, the waiting request is served before any newer one."""
    eng = make_engine(tiny_ckpt, page_size=16, num_pages=16)
    eng.scheduler.skip_ahead_limit = 2
    a = eng.add_request([3] * 100, SamplingParams(max_tokens=30, **GREEDY))
    eng.step()
    b = eng.add_request([4] * 150, SamplingParams(max_tokens=4, **GREEDY))
    small = [eng.add_request([5 + i] * 4, SamplingParams(max_tokens=2, **GREEDY)) for i in range(4)]
    admitted, step = {}, 0  # request id -> the step that admitted it
    while eng.has_unfinished():
        waiting = {r.request_id for r in eng.scheduler.waiting}
        eng.step()
        step += 1
        now = {r.request_id for r in eng.scheduler.waiting}
        admitted.update({rid: step for rid in waiting - now})
    assert admitted[small[0]] < admitted[b] and admitted[small[1]] < admitted[b], admitted
    assert admitted[b] <= admitted[small[2]] and admitted[b] <= admitted[small[3]], admitted
    del a


def test_request_outgrowing_the_whole_cache_finishes_by_length(tiny_ckpt):
    """A request past the engine's checks (queued directly) that outgrows the cache is finished, not recomputed in a
    loop, and the next request is served."""
    eng = make_engine(tiny_ckpt, page_size=16, num_pages=16)
    eng.max_model_len = eng.post.max_model_len = 10_000  # as if the cache were never checked
    sp = SamplingParams(max_tokens=300, **GREEDY)
    req = eng._add([5, 6, 7], sp)
    eng.scheduler.add(req)
    evs = _events(eng)
    assert evs[-1].request_id == req.request_id and evs[-1].finish_reason == "length"
    n = sum(len(e.new_token_ids) for e in evs)
    assert 250 <= n < 256, n
    assert eng.pool.num_free == eng.pool.num_pages
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    assert len(run_all(eng)[rid]) == 4


def test_prompt_larger_than_the_cache_queued_directly_is_finished(tiny_ckpt):
    eng = make_engine(tiny_ckpt, page_size=16, num_pages=16, chunked_prefill_size=512)
    req = eng._add([5] * 300, SamplingParams(max_tokens=2, **GREEDY))  # past the engine's checks
    eng.scheduler.add(req)
    evs = _events(eng, limit=10)
    assert [(e.request_id, e.finish_reason) for e in evs] == [(req.request_id, "length")]
