"""KVPool: exact page accounting, prefix matching, LRU eviction."""

import random

import pytest

from mlaserve.engine.kv_pool import KVPool


def test_allocate_free_accounting():
    pool = KVPool(8, 4)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert pool.allocate(1) is None and pool.num_free == 0
    pool.free(a)
    assert pool.num_free == 3
    pool.free(b)
    pool.check()
    assert pool.num_free == 8


def test_prefix_match_and_commit():
    pool = KVPool(16, 4)
    toks = list(range(10))  # 2 full pages + 2 tokens
    pages = pool.allocate(3)
    assert pool.commit(toks, pages, num_computed=10, num_committed=0) == 2
    # A second request with the same first 9 tokens and another tail shares the 2 full pages.
    m = pool.match_prefix(toks[:9] + [99, 98])
    assert m == pages[:2] and pool.ref[pages[0]] == 2
    pool.free(m)
    pool.free(pages)
    pool.check()
    # Cached pages stay resident (evictable) and still match after their owner is gone.
    m = pool.match_prefix(toks)
    assert m == pages[:2]
    pool.free(m)
    assert pool.num_free == 16


def test_match_leaves_last_token_uncached():
    pool = KVPool(8, 4)
    toks = list(range(8))  # exactly 2 pages
    pages = pool.allocate(2)
    pool.commit(toks, pages, 8, 0)
    pool.free(pages)
    assert len(pool.match_prefix(toks)) == 1  # only 7 tokens may match -> one full page
    pool.free(pool.match_prefix(toks[:5]))  # 4 tokens match -> 1 page
    pool.free([pages[0]])
    pool.check()


def test_eviction_lru_and_random_churn():
    rng = random.Random(0)
    pool = KVPool(32, 4)
    live = []
    for _step in range(500):
        if live and rng.random() < 0.5:
            toks, pages = live.pop(rng.randrange(len(live)))
            pool.free(pages)
        else:
            toks = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            got = pool.match_prefix(toks)
            need = pool.pages_for(len(toks)) - len(got)
            new = pool.allocate(need)
            if new is None:
                pool.free(got)
                continue
            pages = got + new
            pool.commit(toks, pages, len(toks), len(got))
            live.append((toks, pages))
        pool.check()
    for _, pages in live:
        pool.free(pages)
    pool.check()
    assert pool.num_free == 32


def _cached_request(pool, toks):
    """A request of one full page whose KV is computed and registered, then finished (its page evictable)."""
    pages = pool.allocate(1)
    pool.commit(toks, pages, len(toks), 0)
    pool.free(pages)
    return pages[0]


def test_eviction_takes_the_least_recently_used_page_first():
    pool = KVPool(4, 2)
    a, b, c = ([i, i] for i in (1, 2, 3))
    pa, pb, pc = (_cached_request(pool, t) for t in (a, b, c))
    assert list(pool.evictable) == [pa, pb, pc]  # finished in this order: a is the least recently used
    pool.free(pool.match_prefix(a + [9]))  # a hit makes a the most recently used: b, c, a
    assert list(pool.evictable) == [pb, pc, pa]
    fresh = pool.allocate(1)  # a free page first: nothing evicted
    assert fresh not in ([pa], [pb], [pc]) and len(pool.evictable) == 3
    assert pool.allocate(1) == [pb]  # then the LRU cached page: b's
    assert pool.match_prefix(b + [9]) == [] and pool.num_free == 2
    hit = pool.match_prefix(c + [9])  # c still cached; held, so the next eviction skips it
    assert hit == [pc]
    assert pool.allocate(1) == [pa]
    assert pool.match_prefix(a + [9]) == [] and pool.allocate(1) is None  # c is held: nothing left to evict
    pool.free(hit)
    pool.check()


def test_shared_pages_are_counted_once():
    pool = KVPool(8, 4)
    toks = list(range(10))
    first = pool.allocate(3)
    pool.commit(toks, first, 10, 0)
    second = pool.match_prefix(toks[:8] + [50, 51, 52])  # both full pages shared with the live first request
    second += pool.allocate(pool.pages_for(11) - len(second))
    assert second[:2] == first[:2] and second[2] != first[2]
    assert [pool.ref[p] for p in first] == [2, 2, 1] and pool.ref[second[2]] == 1
    assert pool.num_used == 4  # 3 + 3 pages held, 2 of them shared
    pool.free(first)
    assert pool.num_used == 3 and [pool.ref[p] for p in second] == [1, 1, 1]
    pool.free(second)
    pool.check()
    assert pool.num_free == 8


def test_lookup_stats_add_up():
    pool = KVPool(4, 2)
    assert (pool.queries, pool.hits) == (0, 0)
    pool.record_lookup(10, 4)
    pool.record_lookup(6, 0)
    assert (pool.queries, pool.hits) == (16, 4)


def test_reset_prefix_cache_frees_only_unheld_pages():
    pool = KVPool(4, 2)
    held = pool.allocate(1)
    pool.commit([1, 1], held, 2, 0)
    idle = _cached_request(pool, [2, 2])
    pool.reset_prefix_cache()
    assert pool.match_prefix([2, 2, 9]) == [] and idle in pool.free_pages and not pool.evictable
    assert pool.num_free == 3 and pool.ref[held[0]] == 1
    pool.check()
    pool.free(held)  # the held page keeps its hash until its owner frees it
    assert list(pool.evictable) == held


def test_misuse_is_caught():
    pool = KVPool(4, 2)
    with pytest.raises(AssertionError, match="page 3 is not held"):
        pool.share([3])
    pages = pool.allocate(1)
    pool.free(pages)
    with pytest.raises(AssertionError, match=f"page {pages[0]} freed twice"):
        pool.free(pages)


@pytest.mark.parametrize(
    "corrupt,msg",
    [
        (lambda pool, p: pool.free_pages.append(pool.free_pages[0]), "^duplicate page in free list$"),
        (lambda pool, p: pool.free_pages.append(p), "^$"),  # a held page also free: the overlap assertion itself
        (lambda pool, p: pool.free_pages.remove(3), "^a page is lost$"),
    ],
)
def test_check_names_the_broken_invariant(corrupt, msg):
    pool = KVPool(4, 2)
    p = pool.allocate(1)[0]
    pool.check()
    corrupt(pool, p)
    with pytest.raises(AssertionError, match=msg):
        pool.check()
