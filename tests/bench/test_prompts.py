"""Prompts are a pure function of seed, length, vocabulary and excluded ids."""

import numpy as np
import pytest

from mlaserve.bench.prompts import (
    WARMUP_PREFIX_STREAM,
    poisson_arrivals,
    prompts_sha256,
    random_prompts,
    special_ids_from_card,
    with_shared_prefix,
)


def test_same_seed_same_prompts():
    a = random_prompts(8, 64, seed=20260724, vocab_size=512)
    b = random_prompts(8, 64, seed=20260724, vocab_size=512)
    assert a.shape == (8, 64) and a.dtype == np.int64
    assert np.array_equal(a, b) and prompts_sha256(a) == prompts_sha256(b)
    c = random_prompts(8, 64, seed=20260725, vocab_size=512)
    assert not np.array_equal(a, c) and prompts_sha256(a) != prompts_sha256(c)


def test_pinned_values():
    # pins numpy Generator(seed).integers: if this changes, old results no longer compare with new ones
    a = random_prompts(2, 4, seed=20260724, vocab_size=32000)
    assert np.array_equal(a, np.random.default_rng(20260724).integers(0, 32000, size=(2, 4)))


def test_range_and_exclusions():
    a = random_prompts(4, 2000, seed=1, vocab_size=300, exclude=[0, 1, 256, 257, 9999])
    assert a.min() >= 2 and a.max() < 300
    assert not np.isin(a, [0, 1, 256, 257]).any()
    w = random_prompts(4, 2000, seed=1, vocab_size=300, exclude=[0, 1, 256, 257], stream=1)
    assert not np.array_equal(a, w)  # warmups never replay (and prefix-cache) the timed prompts
    with pytest.raises(ValueError, match="input_len"):
        random_prompts(1, 0, seed=1, vocab_size=10)
    with pytest.raises(ValueError, match="vocab_size"):
        random_prompts(1, 1, seed=1, vocab_size=2, exclude=[0, 1])


def test_arrivals_and_card():
    assert poisson_arrivals(3, float("inf"), 1) == [0.0, 0.0, 0.0]
    t = poisson_arrivals(1000, 10.0, 1)
    assert t == poisson_arrivals(1000, 10.0, 1) and all(x < y for x, y in zip(t, t[1:]))
    assert 80 < t[-1] < 120  # 1000 arrivals at 10/s
    card = {"id": "m", "vocab_size": 512, "bos_token_id": 256, "eos_token_id": [257, 258], "special_token_ids": [3]}
    assert special_ids_from_card(card) == [3, 256, 257, 258]
    assert special_ids_from_card({"id": "m"}) == []


def test_shared_prefix():
    own = random_prompts(4, 8, seed=1, vocab_size=300, exclude=[0, 1])
    assert with_shared_prefix(own, 0, 1, 300) is own  # no prefix: the prompts unchanged (and their digest)
    p = with_shared_prefix(own, 16, seed=1, vocab_size=300, exclude=[0, 1])
    assert p.shape == (4, 24) and np.array_equal(p[:, 16:], own)
    assert (p[:, :16] == p[0, :16]).all() and not np.isin(p[:, :16], [0, 1]).any()
    assert np.array_equal(p, with_shared_prefix(own, 16, seed=1, vocab_size=300, exclude=[0, 1]))
    w = with_shared_prefix(own, 16, seed=1, vocab_size=300, exclude=[0, 1], stream=WARMUP_PREFIX_STREAM)
    assert not np.array_equal(w[0, :16], p[0, :16])  # the warm-ups' prefix is another: they cache none of the run's
    assert not np.array_equal(p[0, :16], own[0, :8].repeat(2))
    with pytest.raises(ValueError, match="prefix_len"):
        with_shared_prefix(own, -1, 1, 300)
