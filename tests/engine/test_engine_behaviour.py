"""Batch invariance, the prefix cache, aborts, bad inputs: the engine keeps serving everyone else."""

import random

import pytest

from mlaserve.types import SamplingParams

from .conftest import make_engine, run_all, run_requests


def _prompts(n, seed=7, lo=5, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_batch_invariance(tiny_ckpt, params):
    engine = make_engine(tiny_ckpt)
    target = _prompts(1, seed=99)[0]
    others = _prompts(6)
    rid = engine.add_request(target, params)
    alone = run_all(engine)[rid]
    results = [alone]
    for order in (others[:3] + [target] + others[3:], [target] + others[::-1]):
        rids = [
            engine.add_request(p, params if p is target else SamplingParams(temperature=1.0, max_tokens=9))
            for p in order
        ]
        got = run_all(engine)
        results.append(got[rids[order.index(target)]])
    assert results[0] == results[1] == results[2], results


def test_seed_reproducible_and_distinct(tiny_ckpt):
    engine = make_engine(tiny_ckpt)
    p = _prompts(1)[0]
    runs = []
    for seed in (1, 1, 2):
        rid = engine.add_request(p, SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True))
        runs.append(run_all(engine)[rid])
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("page_size", [16, 64])
def test_prefix_cache_hit_same_output(tiny_ckpt, page_size):
    rng = random.Random(3)
    prefix = [rng.randrange(512) for _ in range(200)]
    a, b = prefix + [1, 2, 3], prefix + [4, 5, 6, 7]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for caching in (True, False):
        engine = make_engine(tiny_ckpt, page_size=page_size, enable_prefix_caching=caching)
        ra = engine.add_request(a, sp)
        run_all(engine)
        rb = engine.add_request(b, sp)
        seen = []
        while engine.has_unfinished():
            for o in engine.step():
                seen.append(o)
        outs[caching] = [o for o in seen if o.request_id == rb]
        cached = outs[caching][-1].usage.cached_tokens
        if caching:
            assert cached == (200 // page_size) * page_size and engine.stats()["prefix_cache_hits"] >= cached
        else:
            assert cached == 0
        del ra
    tok = lambda evs: [t for o in evs for t in o.new_token_ids]  # noqa: E731
    assert tok(outs[True]) == tok(outs[False])


def test_reset_prefix_cache_forgets_every_prefix_when_idle(tiny_ckpt):
    """reset_prefix_cache: refused (None) while a request is unfinished; when idle it frees every cached page, and
    the same prompt is then computed whole (no cached tokens), with the same greedy tokens."""
    prompt = [random.Random(5).randrange(512) for _ in range(40)]
    engine = make_engine(tiny_ckpt, page_size=16, num_pages=64)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def once():
        rid = engine.add_request(prompt, sp)
        outs = [o for o in run_all_events(engine) if o.request_id == rid]
        return [t for o in outs for t in o.new_token_ids], outs[-1].usage.cached_tokens

    first, _ = once()
    again, hit = once()
    assert hit == 32 and again == first
    engine.add_request(prompt, sp)
    assert engine.reset_prefix_cache() is None and len(engine.pool.cached) > 0
    run_all(engine)
    # 46 tokens: 2 full pages of 16 cached (the third is not full)
    assert engine.reset_prefix_cache() == 2 and not engine.pool.cached and engine.pool.num_used == 0
    cold, hit = once()
    assert hit == 0 and cold == first


def run_all_events(engine):
    seen = []
    while engine.has_unfinished():
        seen += engine.step()
    return seen


def test_live_requests_share_cached_prefix_pages(tiny_ckpt):
    """A request arriving while another with the same prefix is still decoding holds that request's full prefix pages
    by reference: each shared page counted once in the pool, with two references."""
    rng = random.Random(4)
    prefix = [rng.randrange(512) for _ in range(40)]  # 2 full pages of 16 and 8 tokens
    engine = make_engine(tiny_ckpt, page_size=16, num_pages=64)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ra = engine.add_request(prefix + [1, 2], sp)
    while len(engine.pool.cached) < 2:  # a's prefill: its 2 full pages computed and registered (maybe a step late)
        engine.step()
    rb = engine.add_request(prefix + [3, 4, 5], sp)
    a, b = engine.states[ra].req, engine.states[rb].req
    while not b.pages:  # scheduled at the next step (the overlapped loop schedules one step ahead)
        engine.step()
    shared = [p for p in a.pages if p in b.pages]
    assert shared == a.pages[:2] == b.pages[:2] and all(engine.pool.ref[p] == 2 for p in shared)
    assert engine.pool.num_used == len(a.pages) + len(b.pages) - 2  # 3 + 3 held, 2 of them by both
    assert b.num_cached_tokens == 32 and engine.stats()["prefix_cache_hits"] == 32
    run_all(engine)


def test_abort_frees_pages_at_once(tiny_ckpt):
    engine = make_engine(tiny_ckpt, page_size=16)
    rids = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        for p in _prompts(4, lo=40, hi=60)
    ]
    engine.step()
    engine.step()
    used = engine.pool.num_used
    assert used > 0
    engine.abort_request(rids[1])
    assert engine.pool.num_used < used
    engine.abort_request("no-such-request")
    run_all(engine)


BAD = [
    ([], SamplingParams(max_tokens=4), "prompt"),
    ([1] * 5000, SamplingParams(max_tokens=4), "prompt"),
    ([1, 2, 3], SamplingParams(max_tokens=4096), "max_tokens"),
    ([1, 2, 600], SamplingParams(max_tokens=4), "prompt"),
    ([1, -1, 3], SamplingParams(max_tokens=4), "prompt"),
]


@pytest.mark.parametrize("ids,params,field", BAD, ids=["empty", "too_long", "max_tokens", "oov", "negative_id"])
def test_bad_inputs_refused_engine_keeps_serving(tiny_ckpt, ids, params, field):
    engine = make_engine(tiny_ckpt, max_model_len=2048)
    good = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match=field):
        engine.add_request(ids, params)
    out = run_all(engine)
    assert len(out[good]) == 5


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=2.0), "min_p"),
    ],
)
def test_bad_sampling_params(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_stop_token_ids_and_max_tokens(tiny_ckpt):
    engine = make_engine(tiny_ckpt)
    p = _prompts(1)[0]
    rid = engine.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    full = run_all(engine)[rid]
    stop_tok = full[5]
    rid = engine.add_request(
        p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok])
    )
    events = []
    while engine.has_unfinished():
        events += engine.step()
    got = [t for e in events for t in e.new_token_ids]
    assert got == full[: full.index(stop_tok) + 1]
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason == stop_tok


def test_preemption_by_recompute_gives_same_tokens(tiny_ckpt):
    # 4 requests of 30 tokens fill 8 pages of 16; each needs a 3rd page at token 32, so some must be preempted.
    prompts = _prompts(4, seed=11, lo=30, hi=31)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref_engine = make_engine(tiny_ckpt, page_size=16)
    ref = run_all(ref_engine)
    rids = [ref_engine.add_request(p, sp) for p in prompts]
    ref = run_all(ref_engine)
    engine = make_engine(tiny_ckpt, page_size=16, num_pages=8)
    got = run_all(engine)
    rids2 = [engine.add_request(p, sp) for p in prompts]
    got = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [got[r] for r in rids2] == [ref[r] for r in rids]


def test_stop_strings_and_text(tiny_ckpt):
    from mlaserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_ckpt)
    engine = make_engine(tiny_ckpt)
    p = tok.encode("The quick brown fox", add_special_tokens=True)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rid = engine.add_request(p, sp)
    events = []
    while engine.has_unfinished():
        events += engine.step()
    text = "".join(e.new_text for e in events)
    ids = [t for e in events for t in e.new_token_ids]
    assert text == tok.decode(ids)
    # Stop on a string that appears in the middle of that greedy text (spanning tokens where possible).
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if not stop.strip("\ufffd") or "\ufffd" in stop:
        pytest.skip("greedy text has no clean substring to stop on")
    rid = engine.add_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    got = "".join(e.new_text for e in events)
    assert got == text[: text.index(stop)]
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason == stop
    del rid


def test_logprobs_are_returned(tiny_ckpt):
    from mlaserve import LLM

    llm = LLM(tiny_ckpt, device="cpu")
    out = llm.generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0), use_tqdm=False
    )[0]
    lp = out.outputs[0].logprobs
    assert len(lp) == 5 and all(x <= 0 for x in lp)


def test_sampled_logprobs_equal_a_reference_log_softmax(tiny_ckpt):
    """At temperature > 0 the logprob returned is the sampled token's (not the arg-max's) under the model's raw
    log-softmax, and the top alternatives are that row's k most likely tokens with their logprobs."""
    import torch

    from mlaserve import LLM
    from tests.helpers.ref_sampling import model_logits

    llm = LLM(tiny_ckpt, device="cpu")
    prompt = _prompts(1, seed=12)[0]
    sp = SamplingParams(temperature=1.5, seed=21, max_tokens=16, ignore_eos=True, logprobs=4)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    ref = model_logits(llm.engine, prompt + out.token_ids[:-1])[len(prompt) - 1 :].log_softmax(-1)  # [16, V]
    assert len(out.logprobs) == len(out.top_logprobs) == 16
    not_argmax = 0
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-4), i
        not_argmax += tok != int(ref[i].argmax())
        top = out.top_logprobs[i]
        want = torch.topk(ref[i], 4)
        assert set(top) == set(want.indices.tolist()), (i, top)  # the k alternatives, not the arg-max alone
        for t, lp in zip(want.indices.tolist(), want.values.tolist()):
            assert top[t] == pytest.approx(lp, abs=1e-4), (i, t)
        assert top.get(tok, out.logprobs[i]) == pytest.approx(out.logprobs[i], abs=1e-6)
    assert not_argmax >= 8, not_argmax  # the sampled path leaves the arg-max: the test tells the two apart


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_ckpt):
    """SamplingParams.truncate_prompt_tokens (vLLM's): the request runs on the prompt's last k tokens (-1: what
    leaves room for max_tokens in max_model_len); 0, -2 and more than max_model_len are refused naming it."""
    engine = make_engine(tiny_ckpt, page_size=16, num_pages=64)
    rng = random.Random(6)
    prompt = [rng.randrange(512) for _ in range(50)]
    sp = dict(temperature=0, max_tokens=5, ignore_eos=True)
    cut = run_requests(engine, [prompt], [SamplingParams(truncate_prompt_tokens=12, **sp)])
    assert cut == run_requests(engine, [prompt[-12:]], [SamplingParams(**sp)])
    n = engine.max_model_len
    long = [rng.randrange(512) for _ in range(n + 30)]
    rid = engine.add_request(long, SamplingParams(truncate_prompt_tokens=-1, **sp))
    assert engine.states[rid].req.prompt_token_ids == long[-(n - 5) :]
    run_all(engine)
    for bad, says in ((0, "must be -1"), (-2, "must be -1"), (n + 1, "more than max_model_len")):
        with pytest.raises(ValueError, match=f"^truncate_prompt_tokens: .*{says}"):
            engine.add_request(prompt, SamplingParams(truncate_prompt_tokens=bad, **sp))
