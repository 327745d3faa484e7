"""The start-up warm-up (engine/warmup.py): the step shapes it plans cover every eager step the engine can launch
(every decode count, both residues of the token count mod 16, every kernel threshold from both sides, every prefill
graph bucket), and it runs through the engine's runner and EAGLE3 draft without touching the KV pool. That it leaves
nothing to compile on a GPU: tests/gpu/test_no_jit_gpu.py."""

import pytest

from mlaserve.config import SpecConfig
from mlaserve.engine.cuda_graph import PREFILL_MAX_REQS, PREFILL_TOKEN_BUCKETS
from mlaserve.engine.warmup import DENSE_TOKENS, WarmupStep, _chunks, plan, token_edges, token_ladder, warm_up
from mlaserve.kernel_config import KernelConfig
from mlaserve.types import SamplingParams
from tests.engine.conftest import make_engine, run_all


def test_ladder_covers_edges_buckets_and_residues():
    edges = token_edges(KernelConfig(), num_experts=64, top_k=6, n_shared=2)
    # the MoE bands of moe_config (rows per expert 16 / 48 / 160) and KernelConfig's thresholds
    assert {64 // 6, 16 * 64 // 6, 48 * 66 // 6, 160 * 66 // 6, 2, 32, 256} <= set(edges)
    ladder = token_ladder(1, 8192, edges)
    assert set(range(1, DENSE_TOKENS + 1)) <= set(ladder)
    assert set(PREFILL_TOKEN_BUCKETS) - {16384} <= set(ladder)
    for e in edges:
        if e < 8192:
            assert {e, e + 1} <= set(ladder)  # at the edge and past it
            around = [t for t in ladder if e - 16 <= t <= e + 17]
            assert any(t % 16 == 0 for t in around) and any(t % 16 for t in around)
    # a count every 25 %, with both residues mod 16, up to the top
    big = [t for t in ladder if t > DENSE_TOKENS]
    assert all(b / a <= 1.35 for a, b in zip(big, big[1:]))
    assert 8191 in ladder and 8192 in ladder
    assert ladder == sorted(set(ladder)) and ladder[0] == 1


@pytest.mark.parametrize("q", [1, 2, 3])
def test_plan_covers_every_decode_count_mixed_and_prefill(q):
    S, budget, chunk, page, max_len = 64, 2048, 1024, 16, 4096
    steps = plan(q, S, budget, chunk, page, max_len, edges=[32, 256])
    assert all(isinstance(s, WarmupStep) and 1 <= s.tokens <= budget for s in steps)
    assert all(s.q_len == q for s in steps)
    # every decode count beside a prefill chunk, the step's tokens both a multiple of 16 and not
    for n in range(1, S + 1):
        mixed = [s for s in steps if s.decode == n and s.prefill]
        assert {s.tokens % 16 == 0 for s in mixed} == {True, False}, n
    # page tables of 1, 16 and 17 columns among the mixed steps' decode rows
    widths = {-(-(s.context + q) // page) for s in steps if s.decode}
    assert {1, 16, 17} <= widths
    # prefill chunks alone, fresh and after cached context, at every ladder count up to the chunk size
    ladder = token_ladder(1, chunk, [32, 256])
    for cached in (0, page):
        assert {s.prefill for s in steps if s.decode == 0 and s.cached == cached and s.requests == 1} == set(ladder)
    # and split over more requests than a prefill graph holds
    for cached in (0, page):
        split = {s.prefill for s in steps if s.requests == PREFILL_MAX_REQS + 1 and s.cached == cached}
        assert split == {t for t in ladder if t >= 9}
    # and beside a decode
    assert {s.prefill for s in steps if s.decode == 1} >= set(ladder) - {chunk}
    # decode-only steps only when there are no graphs
    assert not [s for s in steps if not s.prefill]
    eager = plan(q, S, budget, chunk, page, max_len, decode_only=True)
    assert {s.decode for s in eager if not s.prefill} == set(range(1, S + 1))


def test_chunks_split_the_prefill_and_cycle_the_pages():
    dec, pre = _chunks(WarmupStep(2, 3, 13, 20, 16, requests=9), num_pages=5, page_size=16)
    assert [len(c.token_ids) for c in dec] == [3, 3] and all(c.num_cached == 13 and c.need_logits == "all" for c in dec)
    assert [len(c.token_ids) for c in pre] == [3, 3] + [2] * 7 and all(c.num_cached == 16 for c in pre)
    assert all(len(c.pages) * 16 >= c.num_cached + len(c.token_ids) for c in dec + pre)
    assert all(0 <= p < 5 for c in dec + pre for p in c.pages)


def test_plan_respects_limits():
    # one sequence: no mixed steps; a prefill never passes max_model_len, a step never the token budget
    steps = plan(1, 1, 512, 512, 16, 300)
    assert steps and all(s.decode == 0 for s in steps)
    assert all(s.cached + -(-s.prefill // s.requests) < 300 and s.tokens <= 512 for s in steps)
    steps = plan(4, 8, 40, 40, 16, 4096)  # the budget leaves little room beside 8 verifies of 4
    assert all(s.tokens <= 40 for s in steps)
    assert not [s for s in steps if s.decode * 4 >= 40 and s.prefill]


def test_warm_up_runs_and_leaves_the_engine_clean(tiny_ckpt):
    eng = make_engine(tiny_ckpt, max_num_seqs=4, max_num_batched_tokens=64, chunked_prefill_size=32, num_pages=8)
    steps = plan(1, 4, 64, 32, eng.cfg.page_size, eng.max_model_len, decode_only=True)
    assert warm_up(eng, steps) >= 0
    assert eng.pool.num_free == eng.pool.num_pages and not eng.has_unfinished()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), request_id="r")
    assert len(run_all(eng)["r"]) == 4


@pytest.mark.parametrize("k", [1, 2, 3])
def test_warm_up_drives_the_eagle3_draft(tiny_ckpt, tmp_path_factory, monkeypatch, k):
    """Every step proposes; a chain of K > 1 writes K - 1 draft tokens past the step's own, so its chunks' pages
    cover them (contexts ending on a page edge would index past the last page otherwise)."""
    from mlaserve.models.make_random_draft import make_random_draft

    draft = make_random_draft(
        "tiny-eagle3", str(tmp_path_factory.mktemp("draft")), target=tiny_ckpt, seed=1, dtype="float32"
    )
    eng = make_engine(
        tiny_ckpt,
        spec=SpecConfig(draft_model=draft, num_steps=k, num_draft_tokens=k + 1),
        max_num_seqs=3,
        max_num_batched_tokens=32,
        chunked_prefill_size=16,
        num_pages=8,
    )
    seen = []
    orig = type(eng.proposer).propose
    monkeypatch.setattr(type(eng.proposer), "propose", lambda self, chunks: seen.append(chunks) or orig(self, chunks))
    steps = plan(k + 1, 3, 32, 16, eng.cfg.page_size, eng.max_model_len)
    warm_up(eng, steps)
    assert len(seen) == len(steps)
    mixed = next(c for c in seen if len(c) > 1)
    assert mixed[0].verify and len(mixed[0].token_ids) == k + 1 and not mixed[-1].verify
    assert eng.pool.num_free == eng.pool.num_pages
