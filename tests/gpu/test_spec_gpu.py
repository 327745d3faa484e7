"""On a GPU, under CUDA graphs: a draft trained on the GPU by train-draft keeps speculative greedy equal to plain for
K = 1, 2, 3 through the draft's captured graph step fed by the verify on the device (one read back a step), and
drafts what the eager engine drafts; the REPLAY draft's acceptance per position is exactly what its misses imply
(full acceptance, none, and partial); verify steps overlapped with the host (positions moved on the device by the
accepted counts) keep greedy equal to plain at several tokens accepted a step, and draft what the serial loop
drafts."""

import random

import pytest

pytestmark = pytest.mark.gpu

MAX = 32


def _prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(1, 200))] for _ in range(n)]


def _greedy(ckpt, prompts, spec=None, sp=None, **kw):
    from mlaserve import LLM, SamplingParams

    llm = LLM(ckpt, device="cuda", dtype="float32", speculative_config=spec, num_pages=2048, page_size=64, **kw)
    draft_runs = []
    graphs = getattr(llm.engine.proposer, "graphs", None) or getattr(
        getattr(llm.engine.proposer, "inner", None), "graphs", None
    )
    if hasattr(graphs, "run_verified"):  # count the steps the draft's captured graphs served (device- or host-fed)
        run_verified = graphs.run_verified
        graphs.run_verified = lambda y, *a: draft_runs.append(y.shape[0]) or run_verified(y, *a)
    step = llm.engine.spec_step_graphs
    if step is not None:  # and the step graphs (engine/spec_graph.py), the draft's step inside
        step_run = step.run
        step.run = lambda key, decode, *a: draft_runs.append(len(decode)) or step_run(key, decode, *a)
    sp = sp or SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [o.token_ids for o in outs], [list(o.usage.spec_accepted_per_position) for o in outs], llm, draft_runs


@pytest.fixture(scope="module")
def trained(tiny_ckpt, tmp_path_factory):
    from mlaserve.train.train_draft import train_draft

    out = str(tmp_path_factory.mktemp("trained"))
    info = train_draft(tiny_ckpt, out, steps=300, num_prompts=256, max_len=64, lr=1e-2, device="cuda", progress=False)
    print(f"\ntrain-draft on {out}: {info}")
    return out


@pytest.fixture(scope="module")
def plain(tiny_ckpt):
    return _greedy(tiny_ckpt, _prompts())[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_trained_draft_under_graphs_keeps_greedy(tiny_ckpt, trained, plain, k):
    got, per_req, llm, draft_runs = _greedy(tiny_ckpt, _prompts(), {"draft_model": trained, "num_steps": k})
    assert got == plain
    st = llm.engine.stats()
    print(f"K={k}: {st['spec_steps']} verify steps, accepted per position {st['spec_accepted_per_position']}")
    assert st["spec_accepted_per_position"][0] > 0 and draft_runs  # accepted drafts, through the captured step
    assert st["spec_device_steps"] == llm.engine.loop.decode_only_steps > 0  # every decode step on the device
    assert st["overlapped_steps"] > 0  # verify steps launched while the one before was in flight
    assert all(g[0] is not None for g in llm.engine.proposer.graphs.graphs.values())
    gr = llm.engine.runner.graphs  # each greedy decode-only step: one replay of its step graph
    assert gr.graph_replays["spec_step"] == st["spec_device_steps"], (gr.graph_replays, st)
    assert [sum(r[i] for r in per_req) for i in range(k)] == st["spec_accepted_per_position"]


@pytest.mark.parametrize("k", [1, 3])
def test_sampled_requests_verify_on_the_device(tiny_ckpt, trained, plain, k):
    """Sampled requests verify by the speculative-sampling rule on the device, overlapped like greedy ones. With
    top_k = 1 that rule gives the arg-max's tokens: plain greedy's. Seeded requests give the same tokens twice."""
    from mlaserve import SamplingParams

    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=MAX, ignore_eos=True)
    got, _, llm, _ = _greedy(tiny_ckpt, _prompts(), {"draft_model": trained, "num_steps": k}, sp=top1)
    assert got == plain
    st = llm.engine.stats()
    assert st["spec_accepted_per_position"][0] > 0 and st["overlapped_steps"] > 0, st
    assert st["spec_device_steps"] == llm.engine.loop.decode_only_steps > 0, st
    assert llm.engine.runner.graphs.graph_replays.get("spec_step", 0) == 0  # the step graph is greedy's
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=MAX, ignore_eos=True) for i in range(6)]
    runs = [[o.token_ids for o in llm.generate(_prompts(), seeded, use_tqdm=False)] for _ in range(2)]
    assert runs[0] == runs[1] and runs[0] != plain
    llm.close()


@pytest.mark.parametrize("k,rate", [(1, 0.0), (2, 0.0), (3, 0.0), (3, 1.0), (3, 0.3), (2, 0.5)])
def test_replay_exact_acceptance_under_graphs(tiny_ckpt, plain, tmp_path, k, rate):
    from mlaserve.models.make_random_draft import make_random_draft
    from mlaserve.spec.replay import write_recordings

    from ..spec.test_replay import expected_per_position

    prompts = _prompts()
    path = str(tmp_path / "rec.jsonl")
    write_recordings(path, zip(prompts, plain))
    draft = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=tiny_ckpt, dtype="float32")
    spec = dict(algorithm="REPLAY", draft_model=draft, num_steps=k, replay_path=path, replay_miss_rate=rate)
    got, per_req, llm, draft_runs = _greedy(tiny_ckpt, prompts, spec)
    assert got == plain
    assert per_req == [expected_per_position(p, k, rate, 0, max_tokens=MAX) for p in prompts]
    assert draft_runs  # the EAGLE3 draft's captured step ran under the replayed tokens
    st = llm.engine.stats()
    assert st["spec_device_steps"] == llm.engine.loop.decode_only_steps > 0


@pytest.mark.parametrize("k,lo,hi", [(1, 1, 3), (3, 2, 4)])
def test_ngram_exact_acceptance_under_graphs(tiny_ckpt, plain, k, lo, hi):
    """NGRAM (prompt lookup, no draft model) under the step graphs (the lookup kernel inside, overlapped): greedy
    equal to plain, each request's acceptance per position what the lookup rule gives over its plain output."""
    from ..spec.test_ngram import expected_per_position

    prompts = _prompts()
    spec = dict(algorithm="NGRAM", num_steps=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
    got, per_req, llm, step_runs = _greedy(tiny_ckpt, prompts, spec)
    assert got == plain
    assert per_req == [expected_per_position(p, o, k, lo, hi) for p, o in zip(prompts, plain)]
    st = llm.engine.stats()
    assert st["spec_device_steps"] == llm.engine.loop.decode_only_steps > 0
    assert step_runs and st["overlapped_steps"] > 0  # the lookup inside the step graph, overlapped with the host


@pytest.mark.parametrize("k", [1, 3])
def test_device_step_drafts_like_eager(tiny_ckpt, trained, plain, k):
    """The captured draft step fed by the verify on the device against the eager engine (enforce_eager: the host
    path, the draft run eagerly): the same outputs (plain greedy's), the same drafts after every step, and the same
    acceptance."""
    from mlaserve import LLM, SamplingParams

    seen = {}
    for eager in (True, False):
        llm = LLM(
            tiny_ckpt,
            device="cuda",
            dtype="float32",
            speculative_config={"draft_model": trained, "num_steps": k},
            num_pages=2048,
            page_size=64,
            enforce_eager=eager,
        )
        eng, log = llm.engine, {}
        rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)) for p in _prompts()]
        out = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] += o.new_token_ids
            for r in eng.scheduler.running:  # a request's drafts keyed by its length: free of step timing
                if r.request_id in eng.states:
                    log.setdefault((r.request_id, r.num_tokens), list(eng.states[r.request_id].drafts))
        st = eng.stats()
        assert [out[r] for r in rids] == plain
        assert (st["spec_device_steps"] > 0) != eager
        seen[eager] = {(rids.index(r), n): d for (r, n), d in log.items()}, st["spec_accepted_per_position"]
    (d_eager, a_eager), (d_dev, a_dev) = seen[True], seen[False]
    diff = sorted(k for k in d_eager.keys() | d_dev.keys() if d_eager.get(k) != d_dev.get(k))
    assert not diff, [(k, d_eager.get(k), d_dev.get(k)) for k in diff[:8]]
    assert a_eager == a_dev


@pytest.mark.parametrize("k", [1, 3])
def test_overlapped_verify_under_graphs(tiny_ckpt, plain, tmp_path, k):
    """A device oracle draft (tests/helpers/oracle_draft.py: most drafts accepted) through the verify's and the
    draft's captured graphs, overlapped and serial (disable_overlap_schedule): both give plain greedy's outputs,
    only the first overlaps, and their EAGLE3 drafts agree at every (position, accepted count) both saw."""
    import torch

    from mlaserve import LLM, SamplingParams
    from mlaserve.models.make_random_draft import make_random_draft
    from tests.helpers.oracle_draft import install_oracle

    prompts = _prompts()
    draft = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=tiny_ckpt, dtype="float32")
    drafted = {}
    for overlap in (True, False):
        llm = LLM(
            tiny_ckpt,
            device="cuda",
            dtype="float32",
            speculative_config={"draft_model": draft, "num_steps": k},
            num_pages=2048,
            page_size=64,
            disable_overlap_schedule=not overlap,
        )
        eng = llm.engine
        oracle = install_oracle(eng, prompts, plain)
        inner, log = oracle.inner.propose_verified, drafted.setdefault(overlap, {})

        def logged(y, acc, hidden, reqs, starts=None, shift=None, f=inner, lg=log):
            d = f(y, acc, hidden, reqs, starts, shift)
            s = torch.tensor([r.num_computed_tokens for r in reqs] if starts is None else starts, device=y.device)
            lg.setdefault("steps", []).append((reqs, s + (0 if shift is None else shift), acc.clone(), d.clone()))
            return d

        oracle.inner.propose_verified = logged
        rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)) for p in prompts]
        out = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] += o.new_token_ids
        assert [out[r] for r in rids] == plain
        st = eng.stats()
        assert (st["overlapped_steps"] > 0) == overlap, st
        assert st["spec_device_steps"] == eng.loop.decode_only_steps > 0, st
        assert st["spec_accepted_tokens"] > st["spec_steps"] // 2, st
        table = {}
        for reqs, s, a, d in log.pop("steps"):  # read back after the run: no syncs inside it
            for r, x, n, row in zip(reqs, s.tolist(), a.tolist(), d.tolist()):
                table[(tuple(r.prompt_token_ids), x, n)] = row
        drafted[overlap] = table
    assert drafted[False] and {x: drafted[True].get(x) for x in drafted[False]} == drafted[False]


@pytest.mark.parametrize("fmt", ["specforge_llama3", "vllm_yarn_fc_norm", "linear_norm_before_fc", "speculators"])
def test_published_draft_formats_under_graphs(tiny_ckpt, plain, tmp_path, fmt):
    """Each published draft format (tests/spec/test_eagle3_formats.py writes them; one reads four aux states) through
    the Triton GQA attention and the draft's captured step: plain greedy's outputs, the captured step used."""
    from tests.spec.test_eagle3_formats import FORMATS, write_draft

    write_draft(tmp_path / fmt, FORMATS[fmt], seed=5)
    got, _, llm, draft_runs = _greedy(tiny_ckpt, _prompts(), {"draft_model": str(tmp_path / fmt), "num_steps": 2})
    assert got == plain
    assert draft_runs


def test_logprobs_under_graphs(tiny_ckpt, trained):
    """Requests asking for logprobs verify on the device, overlapped, outside the step graph: their tokens, logprobs
    and top alternatives are plain decoding's (fp32), beside requests that asked for none."""
    from mlaserve import LLM, SamplingParams

    prompts = _prompts()
    sp = [SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, logprobs=n) for n in (3, None, 0, 5, 3, 1)]
    kw = dict(device="cuda", dtype="float32", num_pages=2048, page_size=64)
    base = LLM(tiny_ckpt, **kw)
    want = [o.outputs[0] for o in base.generate(prompts, sp, use_tqdm=False)]
    base.close()
    llm = LLM(tiny_ckpt, speculative_config={"draft_model": trained, "num_steps": 2}, **kw)
    got = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
    st = llm.engine.stats()
    assert st["spec_accepted_per_position"][0] > 0 and st["overlapped_steps"] > 0, st
    assert st["spec_device_steps"] == llm.engine.loop.decode_only_steps > 0, st
    for p, a, b in zip(sp, want, got):
        assert a.token_ids == b.token_ids
        if p.logprobs is None:
            assert not b.logprobs
            continue
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
        for x, y in zip(a.top_logprobs, b.top_logprobs):
            assert set(x) == set(y) and [y[t] for t in x] == pytest.approx(list(x.values()), abs=1e-3)
    llm.close()


def test_logits_processors_under_graphs(tiny_ckpt, trained):
    """Penalties, logit_bias and allowed_token_ids under speculation on the GPU: the verify rows processed as plain
    decoding's rows (row i counting the first i drafts), greedy tokens equal plain decoding's (fp32), beside a
    request with none."""
    from mlaserve import LLM, SamplingParams

    g = dict(temperature=0, max_tokens=MAX, ignore_eos=True)
    sp = [
        SamplingParams(repetition_penalty=1.6, **g),
        SamplingParams(frequency_penalty=0.9, presence_penalty=0.6, **g),
        SamplingParams(logit_bias={7: 8.0}, **g),
        SamplingParams(**g),
        SamplingParams(allowed_token_ids=[7, 11, 20, 33, 50], **g),
    ]
    prompts = _prompts(5)
    kw = dict(device="cuda", dtype="float32", num_pages=2048, page_size=64)
    base = LLM(tiny_ckpt, **kw)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, sp, use_tqdm=False)]
    base.close()
    llm = LLM(tiny_ckpt, speculative_config={"draft_model": trained, "num_steps": 2}, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    st = llm.engine.stats()
    assert st["spec_accepted_per_position"][0] > 0 and st["spec_device_steps"] > 0, st
    llm.close()


def test_shipped_draft_accepts_on_the_gpu():
    """The default model and its shipped draft in bf16 on the GPU (the draft's prefill over each prompt, then its
    graph steps): at least 55 % of K=1 drafts accepted on the held-out prompts, the bound the CPU reference meets
    (tests/model/test_default_model.py)."""
    import json
    import os

    from mlaserve import LLM, SamplingParams
    from mlaserve.llm import default_draft_path

    with open(os.path.join(default_draft_path(), "eval_prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f][:12]
    spec = LLM(device="cuda", speculative_config={"method": "eagle3", "num_speculative_tokens": 1})
    spec.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    st = spec.engine.stats()
    spec.close()
    rate = st["spec_accepted_per_position"][0] / st["spec_steps"]
    print(f"\nshipped draft on the GPU, K=1: {st['spec_accepted_per_position'][0]} of {st['spec_steps']} ({rate:.3f})")
    assert rate >= 0.55
