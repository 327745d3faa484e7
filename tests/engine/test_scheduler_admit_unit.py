"""The scheduler's admission alone, over a real KVPool and no model: the order and limits of admission, the bounded
skip-ahead past a request short of pages, forks waiting for and sharing their sibling's prompt pages, and the verify
step's N tokens and reserved pages, each asserted exactly."""

import pytest

from mlaserve.config import EngineConfig
from mlaserve.engine.kv_pool import KVPool
from mlaserve.engine.scheduler import Scheduler
from mlaserve.types import Request, RequestStatus, SamplingParams


def _sched(num_pages: int = 16, page_size: int = 4, decode_q_len: int = 1, caching: bool = True, **cfg) -> Scheduler:
    pool = KVPool(num_pages, page_size, enable_prefix_caching=caching)
    return Scheduler(EngineConfig(model="none", **cfg), pool, decode_q_len=decode_q_len)


def _req(n: int, rid: str, first: int = 1, **params) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=8, **params)
    return Request(list(range(first, first + n)), sp, request_id=rid)


def _step(s: Scheduler, out) -> None:
    """As the engine does after a step: the chunks' tokens computed, a sampled token appended, pages committed."""
    for c in out.chunks:
        c.req.num_computed_tokens += c.num_new
        if c.sample:
            c.req.output_token_ids.append(7)
        s.commit_pages(c.req)


def _plan(out) -> list[tuple[str, int, bool]]:
    return [(c.req.request_id, c.num_new, c.sample) for c in out.chunks]


def test_a_scheduler_decodes_one_token_per_step_by_default():
    assert Scheduler(EngineConfig(model="none"), KVPool(4, 4)).decode_q_len == 1


def test_admission_in_order_under_max_num_seqs_and_the_budget():
    s = _sched(max_num_seqs=2, max_num_batched_tokens=8)
    a, b, c = _req(5, "a"), _req(5, "b", first=20), _req(5, "c", first=40)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert _plan(out) == [("a", 5, True), ("b", 3, False)]  # b: what is left of the budget
    assert s.running == [a, b] and list(s.waiting) == [c] and c.status == RequestStatus.WAITING
    assert a.status == b.status == RequestStatus.RUNNING
    assert s.committed_pages == {"a": 0, "b": 0} and (len(a.pages), len(b.pages)) == (2, 1)
    assert (s.pool.queries, s.pool.hits) == (10, 0)  # each admitted prompt looked up once
    _step(s, out)
    assert _plan(s.schedule()) == [("a", 1, True), ("b", 2, True)]  # c: max_num_seqs running already
    assert list(s.waiting) == [c]


def test_a_prefix_hit_is_recorded_and_computed_from_the_cached_pages():
    s = _sched(num_pages=8)
    a = _req(9, "a")
    s.add(a)
    _step(s, s.schedule())  # a's 2 full pages registered
    b = _req(9, "b")
    s.add(b)
    out = s.schedule()
    assert _plan(out) == [("a", 1, True), ("b", 1, True)]
    assert b.pages[:2] == a.pages[:2] and [s.pool.ref[p] for p in a.pages[:2]] == [2, 2]
    assert (b.num_cached_tokens, b.num_computed_tokens, s.committed_pages["b"]) == (8, 8, 2)
    assert (s.pool.queries, s.pool.hits) == (18, 8)
    # a request that wants prompt logprobs computes every prompt position: no cached pages
    c = _req(9, "c", prompt_logprobs=0)
    s.add(c)
    out = s.schedule()
    assert ("c", 9, True) in _plan(out) and c.num_cached_tokens == 0 and s.committed_pages["c"] == 0
    assert not set(c.pages) & set(a.pages) and (s.pool.queries, s.pool.hits) == (27, 8)


def test_skip_ahead_past_a_request_short_of_pages_is_bounded():
    s = _sched(num_pages=7)
    s.skip_ahead_limit = 2
    a = _req(14, "a")
    s.add(a)
    _step(s, s.schedule())  # a: 4 pages, 3 free
    b = _req(16, "b", first=50)  # 4 pages: short
    c1, c2, c3 = (_req(2, f"c{i}", first=100 + 10 * i) for i in (1, 2, 3))  # 1 page each
    for r in (b, c1, c2, c3):
        s.add(r)
    out = s.schedule()
    assert _plan(out) == [("a", 1, True), ("c1", 2, True), ("c2", 2, True)]  # past b, then the limit is reached
    assert s.bypassed == {"b": 2} and list(s.waiting) == [b, c3] and b.pages == []
    assert b.status == RequestStatus.WAITING and s.pool.num_free == 1
    _step(s, out)
    out = s.schedule()  # c3 would fit its 1 free page, but b waits first now
    assert _plan(out) == [("a", 1, True), ("c1", 1, True), ("c2", 1, True)]
    assert list(s.waiting) == [b, c3] and s.bypassed == {"b": 2}
    _step(s, out)
    s.finish(a, "stop")
    out = s.schedule()
    assert _plan(out) == [("c1", 1, True), ("c2", 1, True), ("b", 16, True), ("c3", 2, True)]
    assert s.bypassed == {} and list(s.waiting) == []


def test_a_bypassed_request_finished_while_waiting_leaves_no_count_behind():
    s = _sched(num_pages=5)
    a = _req(14, "a")
    s.add(a)
    _step(s, s.schedule())  # a: 4 pages, 1 free
    b, c = _req(16, "b", first=50), _req(2, "c", first=90)
    s.add(b), s.add(c)
    s.schedule()
    assert s.bypassed == {"b": 1} and list(s.waiting) == [b]
    s.finish(b, "abort")
    assert s.bypassed == {} and list(s.waiting) == [] and b.status == RequestStatus.FINISHED


def test_skip_ahead_scans_at_most_the_limit_of_short_requests():
    for limit, admitted in ((2, []), (3, ["c"])):  # c would fit the 1 free page
        s = _sched(num_pages=5)
        s.skip_ahead_limit = limit
        a = _req(14, "a")
        s.add(a)
        _step(s, s.schedule())  # a: 4 pages, 1 free
        b1, b2, c = _req(16, "b1", first=50), _req(16, "b2", first=70), _req(2, "c", first=90)
        for r in (b1, b2, c):
            s.add(r)
        out = s.schedule()
        assert [ch.req.request_id for ch in out.prefill] == admitted, limit
        assert list(s.waiting) == [b1, b2, c][: 3 - len(admitted)]
        assert s.bypassed == ({"b1": 1, "b2": 1} if admitted else {})


def test_a_request_that_does_not_fit_while_others_run_waits_with_no_pages():
    s = _sched(num_pages=4)
    a = _req(14, "a")
    s.add(a)
    _step(s, s.schedule())  # a holds all 4 pages
    b = _req(2, "b", first=50)
    s.add(b)
    out = s.schedule()
    assert _plan(out) == [("a", 1, True)] and list(s.waiting) == [b] and b.pages == []
    assert s.cannot_fit == [] and b.status == RequestStatus.WAITING and s.bypassed == {}
    assert (s.pool.queries, s.pool.hits) == (14, 0)  # a refused admission records no lookup


def test_a_fork_waits_for_its_sibling_then_shares_its_full_prompt_pages():
    s = _sched(caching=False, chunked_prefill_size=4)
    src = _req(9, "src")
    fork = _req(9, "fork")
    fork.fork_of = src
    s.add(src), s.add(fork)
    out = s.schedule()  # src computes its first chunk; fork needs (9 - 1) // 4 = 2 pages of it
    assert _plan(out) == [("src", 4, False)] and list(s.waiting) == [fork]
    _step(s, out)
    out = s.schedule()  # src: 4 of 8 computed, fork still waits
    assert _plan(out) == [("src", 4, False)] and list(s.waiting) == [fork]
    _step(s, out)
    out = s.schedule()  # src: 8 computed, the 2 shared pages done
    assert _plan(out) == [("src", 1, True), ("fork", 1, True)]
    assert fork.pages[:2] == src.pages[:2] and [s.pool.ref[p] for p in src.pages] == [2, 2, 1]
    assert (fork.num_cached_tokens, fork.num_computed_tokens, s.committed_pages["fork"]) == (8, 8, 2)
    assert (s.pool.queries, s.pool.hits) == (18, 8)


def test_a_fork_queued_before_its_sibling_waits_for_it():
    s = _sched(caching=False)
    src, fork = _req(9, "src"), _req(9, "fork")
    fork.fork_of = src
    s.add(fork), s.add(src)  # the sibling is still waiting: the fork keeps its place
    out = s.schedule()
    assert _plan(out) == [("src", 9, True)] and list(s.waiting) == [fork]
    _step(s, out)
    assert _plan(s.schedule()) == [("src", 1, True), ("fork", 1, True)] and fork.num_cached_tokens == 8


def test_a_fork_shares_only_its_prompt_pages_of_a_sibling_already_generating():
    s = _sched(caching=False)
    src, fork = _req(9, "src"), _req(9, "fork")
    fork.fork_of = src
    s.add(src)
    for _ in range(4):  # 9 prompt tokens, then 3 decodes: 12 computed, 3 full pages (the 3rd: 1 prompt + 3 generated)
        _step(s, s.schedule())
    assert src.num_computed_tokens == 12 and len(src.pages) == 3
    s.add(fork)
    out = s.schedule()  # (9 - 1) // 4 = 2 pages shared: the 3rd holds src's generated tokens
    assert _plan(out) == [("src", 1, True), ("fork", 1, True)]
    assert fork.pages[:2] == src.pages[:2] and fork.pages[2] not in src.pages and fork.num_computed_tokens == 8


def test_a_fork_of_a_finished_sibling_or_of_a_short_prompt_does_not_wait_nor_share():
    s = _sched(caching=False)
    src, fork = _req(9, "src"), _req(9, "fork")
    fork.fork_of = src
    s.add(src)
    s.finish(src, "abort")
    s.add(fork)
    assert _plan(s.schedule()) == [("fork", 9, True)] and fork.num_cached_tokens == 0
    # a prompt of one page or less shares nothing: both are admitted at once
    s = _sched(caching=False)
    src, fork = _req(4, "src"), _req(4, "fork")
    fork.fork_of = src
    s.add(fork), s.add(src)  # queued before its sibling, yet nothing to wait for
    assert _plan(s.schedule()) == [("fork", 4, True), ("src", 4, True)] and fork.num_cached_tokens == 0


def test_a_preempted_fork_recomputes_without_its_sibling_pages():
    s = _sched(caching=False)
    src, fork = _req(9, "src"), _req(9, "fork")
    fork.fork_of = src
    fork.num_preemptions = 1
    s.add(src)
    _step(s, s.schedule())
    s.add(fork)
    out = s.schedule()
    assert _plan(out) == [("src", 1, True), ("fork", 9, True)] and fork.num_computed_tokens == 0
    assert not set(fork.pages) & set(src.pages) and [s.pool.ref[p] for p in src.pages] == [1, 1, 1]


def test_a_fork_shares_no_more_pages_than_the_prefix_cache_found():
    s = _sched()
    a = _req(9, "a")
    s.add(a)
    _step(s, s.schedule())  # a's 2 full pages registered in the prefix cache
    s.finish(a, "stop")
    src, fork = _req(9, "src"), _req(9, "fork")
    fork.fork_of = src
    s.add(src)
    _step(s, s.schedule())  # src: cached 8, computed 9
    s.add(fork)
    s.schedule()
    # the cache's 2 pages are the sibling's 2 pages: taken from the cache, nothing freed or shared twice
    assert fork.pages[:2] == src.pages[:2] and [s.pool.ref[p] for p in src.pages] == [2, 2, 1]
    assert fork.num_cached_tokens == 8 and s.pool.num_free == 16 - 4


def _vstep(s: Scheduler, out) -> None:
    """_step, but a verify accepts none of its drafts: one position computed, one token sampled."""
    for c in out.chunks:
        c.req.num_computed_tokens += 1 if c in out.decode else c.num_new
        if c.sample:
            c.req.output_token_ids.append(7)
        s.commit_pages(c.req)


def test_verify_steps_feed_n_tokens_and_reserve_pages_past_a_sampling_step():
    s = _sched(decode_q_len=3, chunked_prefill_size=4, max_num_batched_tokens=7)
    a = _req(7, "a")
    s.add(a)
    out = s.schedule()  # a's first chunk of 4 samples nothing: no reserve, 1 page
    assert _plan(out) == [("a", 4, False)] and len(a.pages) == 1
    _vstep(s, out)
    out = s.schedule()  # a's last chunk samples: 7 fed + 2 reserved = 9 tokens, 3 pages
    assert _plan(out) == [("a", 3, True)] and out.decode == [] and len(a.pages) == 3
    _vstep(s, out)
    b = _req(3, "b", first=50)
    s.add(b)
    out = s.schedule()  # a verifies: N = 3 fed from position 7, + 2 reserved = 12 tokens, 3 pages; b: 3 + 2
    assert _plan(out) == [("a", 3, True), ("b", 3, True)] and [c.req for c in out.decode] == [a]
    assert (len(a.pages), len(b.pages)) == (3, 2) and out.num_tokens == 6
    _vstep(s, out)
    c = _req(2, "c", first=90)
    s.add(c)
    out = s.schedule()  # a's 3 and b's 3 (verifying now: 3 + 3 + 2 = 8 tokens) leave 1 for c's first token
    assert _plan(out) == [("a", 3, True), ("b", 3, True), ("c", 1, False)]
    assert [ch.req for ch in out.decode] == [a, b] and (len(a.pages), len(b.pages), len(c.pages)) == (4, 2, 1)
    _vstep(s, out)
    # c's last prompt token has no drafts to verify with: it is a 1-token sampling prefill, which fits the 7
    out = s.schedule()
    assert _plan(out) == [("a", 3, True), ("b", 3, True), ("c", 1, True)] and [ch.req for ch in out.decode] == [a, b]
    _vstep(s, out)
    out = s.schedule()  # now c verifies too: a's, b's and c's 3 are 9 > 7, so c waits a step
    assert _plan(out) == [("a", 3, True), ("b", 3, True)] and s.running == [a, b, c]


def test_an_exhausted_budget_schedules_no_empty_chunk():
    s = _sched(decode_q_len=3, chunked_prefill_size=4, max_num_batched_tokens=9)
    a, b = _req(2, "a"), _req(2, "b", first=20)
    c, d, e = _req(12, "c", first=40), _req(12, "d", first=60), _req(2, "e", first=80)
    for r in (a, b, c, d, e):
        s.add(r)
    out = s.schedule()  # e, waiting, is not admitted with an empty chunk either
    assert _plan(out) == [("a", 2, True), ("b", 2, True), ("c", 4, False), ("d", 1, False)]
    assert list(s.waiting) == [e] and e.pages == []
    _step(s, out)
    out = s.schedule()  # a's and b's verifies leave 3 for c: d, mid-prefill, gets nothing (not an empty chunk)
    assert _plan(out) == [("a", 3, True), ("b", 3, True), ("c", 3, False)] and s.running == [a, b, c, d]
    assert list(s.waiting) == [e] and (len(c.pages), len(d.pages)) == (2, 1)  # c: 7 tokens, no reserve (no sample)


def test_a_running_prefill_takes_the_last_token_of_the_budget():
    s = _sched(chunked_prefill_size=4, max_num_batched_tokens=3)
    a, b, c = _req(1, "a"), _req(1, "b", first=20), _req(12, "c", first=40)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert _plan(out) == [("a", 1, True), ("b", 1, True), ("c", 1, False)]
    _step(s, out)
    assert _plan(s.schedule()) == [("a", 1, True), ("b", 1, True), ("c", 1, False)]


@pytest.mark.parametrize("mode", ["deterministic", "speculative", "plain"])
def test_a_prompts_last_token_alone(mode):
    """A prompt one token longer than the chunk: with speculation or in deterministic mode its last token is a
    1-token sampling prefill (a verify has no drafts yet; the first output token comes from the prefill path
    whatever the chunking); on the plain path it rides a decode row (the decode graph). Once it has output it
    decodes either way."""
    kw = dict(chunked_prefill_size=4, max_num_batched_tokens=16)
    if mode == "speculative":
        s = _sched(decode_q_len=2, **kw)
    else:
        s = _sched(**kw, deterministic=mode == "deterministic")
    a = _req(5, "a")
    s.add(a)
    out = s.schedule()
    assert _plan(out) == [("a", 4, False)]
    _step(s, out)
    out = s.schedule()
    if mode == "plain":
        assert [c.req for c in out.decode] == [a] and out.prefill == [] and _plan(out) == [("a", 1, True)]
        return
    assert _plan(out) == [("a", 1, True)] and out.decode == [] and out.prefill[0].req is a
    _step(s, out)
    out = s.schedule()
    assert [c.req for c in out.decode] == [a] and _plan(out) == [("a", s.decode_q_len, True)]
