"""KVPool: exact page accounting, prefix matching, LRU eviction."""

import random

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
