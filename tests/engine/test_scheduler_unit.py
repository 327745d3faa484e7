"""The scheduler alone, over a real KVPool and no model: preemption's counts, the overlapped decode and verify plans,
and the prefix-cache commits, each asserted exactly."""

import pytest

from mlaserve.config import EngineConfig
from mlaserve.engine.kv_pool import KVPool
from mlaserve.engine.scheduler import Scheduler
from mlaserve.types import Request, RequestStatus, SamplingParams


def _sched(num_pages: int = 8, page_size: int = 4, decode_q_len: int = 1, **cfg) -> Scheduler:
    return Scheduler(EngineConfig(model="none", **cfg), KVPool(num_pages, page_size), decode_q_len=decode_q_len)


def _req(n: int, rid: str, first: int = 1) -> Request:
    return Request(list(range(first, first + n)), SamplingParams(temperature=0, max_tokens=8), request_id=rid)


def _step(s: Scheduler, out) -> None:
    """As the engine does after a step: the chunks' tokens computed, a sampled token appended, pages committed."""
    for c in out.chunks:
        c.req.num_computed_tokens += c.num_new
        if c.sample:
            c.req.output_token_ids.append(7)
        s.commit_pages(c.req)


def test_preemption_counts_once_per_preemption_and_recomputes_from_zero():
    s = _sched(num_pages=4, page_size=4)
    a, b = _req(7, "a"), _req(7, "b", first=50)
    s.add(a), s.add(b)
    _step(s, s.schedule())  # both admitted: 2 pages each, the pool is full
    assert [r.status for r in (a, b)] == [RequestStatus.RUNNING] * 2
    _step(s, s.schedule())  # 8 tokens each: both fit their 2 pages
    out = s.schedule()  # a needs a 3rd page: b, the newest, is preempted
    assert out.preempted == [b] and [c.req for c in out.chunks] == [a]
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.pages == [] and b.status == RequestStatus.WAITING
    assert list(s.waiting) == [b]
    s.finish(a, "stop")
    assert "a" not in s.committed_pages and "b" not in s.committed_pages  # released: no entry left behind
    out = s.schedule()
    # recomputed: its first page is still in the prefix cache (the second was evicted for a's third), 5 tokens left
    assert [(c.req, c.num_new) for c in out.prefill] == [(b, 5)] and b.num_computed_tokens == 4
    assert b.num_cached_tokens == 0  # the first schedule's figure, kept after a preemption
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    # a second preemption of the same request counts again
    c = _req(3, "c", first=90)
    s.add(c)
    s._preempt(b)
    assert b.num_preemptions == 2 and s.num_preemptions == 2


def test_cannot_fit_is_finished_by_length():
    s = _sched(num_pages=2, page_size=4, chunked_prefill_size=64)
    r, small = _req(12, "big"), _req(3, "small", first=50)
    s.add(r), s.add(small)
    out = s.schedule()  # the request behind it is admitted in the same step
    assert [(c.req, c.num_new) for c in out.chunks] == [(small, 3)] and s.cannot_fit == [r]
    assert r.status == RequestStatus.FINISHED and r.finish_reason == "length" and r.stop_reason is None
    assert s.pool.num_free == 1 and list(s.waiting) == []


def test_schedule_decode_and_verify_plan_pages_and_chunks():
    s = _sched(num_pages=6, page_size=4)
    a = _req(3, "a")
    s.add(a)
    _step(s, s.schedule())  # 3 prompt tokens computed, 1 sampled: 4 tokens, 1 page
    assert len(a.pages) == 1
    out = s.schedule_decode([a])  # feeds token 4, sampled at position 4: a 2nd page
    assert [(c.req, c.num_new, c.sample) for c in out.decode] == [(a, 1, True)] and out.prefill == []
    assert len(a.pages) == 2
    out = s.schedule_verify([a], num_new=3, reserve=9)  # pages for num_computed_tokens 3 + 9 = 12 tokens
    assert [(c.req, c.num_new, c.sample) for c in out.decode] == [(a, 3, True)] and out.prefill == []
    assert len(a.pages) == 3 and out.num_tokens == 3
    out = s.schedule_verify([a], num_new=3, reserve=8)  # 11 tokens: the 3 pages suffice
    assert len(a.pages) == 3 and s.pool.num_free == 3


def test_overlapped_plans_without_pages_raise_naming_the_request():
    s = _sched(num_pages=1, page_size=4)
    a = _req(3, "a")
    s.add(a)
    _step(s, s.schedule())
    with pytest.raises(RuntimeError, match=r"^a: no KV page for an overlapped decode step$"):
        s.schedule_decode([a])
    with pytest.raises(RuntimeError, match=r"^a: no KV page for an overlapped verify step$"):
        s.schedule_verify([a], num_new=2, reserve=6)


def test_commit_pages_registers_each_full_page_once():
    s = _sched(num_pages=8, page_size=4)
    a = _req(9, "a")
    s.add(a)
    out = s.schedule()
    assert s.committed_pages["a"] == 0
    _step(s, out)  # 9 computed: 2 full pages
    assert s.committed_pages["a"] == 2 and len(s.pool.cached) == 2
    s.commit_pages(a)  # nothing new filled: unchanged
    assert s.committed_pages["a"] == 2 and len(s.pool.cached) == 2
    # a second request with the same prompt finds both pages
    b = _req(9, "b")
    s.add(b)
    out = s.schedule()
    assert b.num_cached_tokens == 8 and [(c.req, c.num_new) for c in out.prefill] == [(b, 1)]
    # prefix caching off: nothing is registered
    off = Scheduler(EngineConfig(model="none"), KVPool(8, 4, enable_prefix_caching=False))
    c = _req(9, "c")
    off.add(c)
    _step(off, off.schedule())
    assert off.committed_pages["c"] == 0 and off.pool.cached == {}


def test_commit_pages_calls_the_pool_only_when_a_page_filled():
    s = _sched(num_pages=8, page_size=4, chunked_prefill_size=3)
    calls, commit = [], s.pool.commit

    def spy(ids, pages, computed, committed):
        calls.append((computed, committed))
        return commit(ids, pages, computed, committed)

    s.pool.commit = spy
    a = _req(9, "a")
    s.add(a)
    for _ in range(5):  # chunks of 3, 3 and 3 (samples), then 2 decodes: 3, 6, 9, 10, 11 computed
        _step(s, s.schedule())
    # (computed, pages committed before): the first page filled at 6 computed, the second at 9; never at 3, 10, 11
    assert calls == [(6, 0), (9, 1)]
    assert s.committed_pages["a"] == 2 and len(s.pool.cached) == 2


def test_chunked_prefill_under_the_budget_and_the_chunk_size():
    s = _sched(num_pages=16, page_size=4, chunked_prefill_size=4, max_num_batched_tokens=6)
    a, b = _req(10, "a"), _req(10, "b", first=50)
    s.add(a), s.add(b)
    plan, pages = [], []
    for _ in range(4):
        out = s.schedule()
        plan.append([(c.req.request_id, c.num_new, c.sample) for c in out.chunks])
        pages.append((len(a.pages), len(b.pages)))  # the pages of the tokens fed: no reserve without speculation
        assert [c.req for c in out.decode] == [
            c.req for c in out.chunks if c.req.num_tokens - c.req.num_computed_tokens == 1
        ]
        _step(s, out)
    assert plan == [
        [("a", 4, False), ("b", 2, False)],  # a: one chunk of 4; b: what is left of the budget
        [("a", 4, False), ("b", 2, False)],
        [("a", 2, True), ("b", 4, False)],  # a's last chunk samples
        [("a", 1, True), ("b", 2, True)],  # a decodes (in decode, first); b's last chunk
    ]
    assert pages == [(1, 1), (2, 1), (3, 2), (3, 3)]
