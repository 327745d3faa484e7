"""The CUDA-graph path's static buffers and padding, run eagerly on CPU (use_graphs=False): same tokens as the
plain path, for decode buckets (q_len 1 and verify width N) and prefill buckets."""

import random

import pytest

from mlaserve.types import SamplingParams

from .conftest import make_engine, run_all


def _prompts(n, seed=5, hi=120):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(1, hi))] for _ in range(n)]


def _gen(engine, prompts):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    rids = [engine.add_request(p, sp) for p in prompts]
    out = run_all(engine)
    return [out[r] for r in rids]


@pytest.mark.parametrize("n", [1, 3, 5])
def test_static_path_matches_eager(tiny_ckpt, n):
    prompts = _prompts(n)
    ref = _gen(make_engine(tiny_ckpt, page_size=16), prompts)
    engine = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4, prefill_graph_max_tokens=512)
    engine.runner.capture_graphs(1, engine.max_model_len, use_graphs=False)
    from mlaserve.attention.base import SeqChunk
    from mlaserve.engine.cuda_graph import decode_graph_size

    for n in range(1, 6):  # the graph a decode step replays is the one eager steps are planned for
        key = engine.runner.graphs.key_for([SeqChunk([0], 0, [0])] * n, [])
        b = decode_graph_size(n, 1, 4, float("inf"))
        assert key == (None if b is None else ("decode", b)), (n, key, b)
    used = []
    orig = engine.runner.graphs.run
    engine.runner.graphs.run = lambda key, d, p, *a: (used.append(key), orig(key, d, p, *a))[1]
    assert _gen(engine, prompts) == ref
    assert any(k[0] == "decode" for k in used) and any(k[0] == "prefill" for k in used)
    runs = engine.runner.graphs.static_runs  # what ran, counted by the runner itself
    assert runs["decode"] == sum(k[0] == "decode" for k in used) and runs["prefill"] == len(used) - runs["decode"]
    assert runs["verify"] == 0 and not engine.runner.graphs.graph_replays  # eager: nothing captured to replay
    assert engine.runner.graph_steps == len(used)


def test_release_graphs_then_eager(tiny_ckpt):
    """release_graphs (TP ranks call it before leaving the group) drops every graph; the runner then runs eagerly
    and generates the same tokens."""
    prompts = _prompts(2)
    ref = _gen(make_engine(tiny_ckpt, page_size=16), prompts)
    engine = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4, prefill_graph_max_tokens=512)
    engine.runner.capture_graphs(1, engine.max_model_len, use_graphs=False)
    graphs = engine.runner.graphs
    engine.runner.release_graphs()
    assert engine.runner.graphs is None and not graphs.graphs
    assert _gen(engine, prompts) == ref


def test_static_path_with_speculation(tiny_ckpt, tmp_path):
    from mlaserve.config import EngineConfig, SpecConfig
    from mlaserve.engine.engine import LLMEngine
    from mlaserve.models.make_random_draft import make_random_draft

    draft = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=tiny_ckpt, dtype="float32")
    prompts = _prompts(3)
    ref = _gen(make_engine(tiny_ckpt, page_size=16), prompts)
    eng = LLMEngine(
        EngineConfig(model=tiny_ckpt, device="cpu", page_size=16, max_num_seqs=4),
        spec=SpecConfig(draft_model=draft, num_steps=2),
    )
    eng.runner.capture_graphs(3, eng.max_model_len, use_graphs=False)
    verifies = []
    fwd = eng.runner.execute_local
    eng.runner.execute_local = lambda decode, prefill, *a: (
        verifies.append(len(decode)) if decode and not prefill else None,
        fwd(decode, prefill, *a),
    )[1]
    assert _gen(eng, prompts) == ref
    # every verify step (decode chunks of q_len 3, no prefill beside them) took the static path
    runs = eng.runner.graphs.static_runs
    assert verifies and runs["verify"] == len(verifies) and runs["decode"] == 0, (runs, verifies)
    eng.pool.check()
    assert eng.pool.num_free == eng.pool.num_pages


@pytest.mark.parametrize("k", [1, 3])
def test_draft_graph_static_path_proposes_like_eager(tiny_ckpt, tmp_path, k):
    """The draft's static step (all N verified rows, K-1 chained steps, padded batch), fed by the verify on the device
    (the default on the CPU), proposes the eager draft's tokens, and the outputs stay the plain engine's."""
    from mlaserve.config import EngineConfig, SpecConfig
    from mlaserve.engine.engine import LLMEngine
    from mlaserve.models.make_random_draft import make_random_draft

    draft = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=tiny_ckpt, dtype="float32")
    prompts = _prompts(3)
    ref = _gen(make_engine(tiny_ckpt, page_size=16), prompts)
    seen = {}
    for mode in ("eager", "static"):
        eng = LLMEngine(
            EngineConfig(model=tiny_ckpt, device="cpu", page_size=16, max_num_seqs=4),
            spec=SpecConfig(draft_model=draft, num_steps=k),
        )
        if mode == "eager":
            eng.proposer.graphs = None
        log = seen[mode] = []
        step = eng.step

        def logged(s=step, e=eng, lg=log):
            out = s()
            lg.append([e.states[r.request_id].drafts for r in e.scheduler.running if r.request_id in e.states])
            return out

        eng.step = logged
        assert _gen(eng, prompts) == ref
        assert (eng.stats()["spec_device_steps"] > 0) == (mode == "static")
        eng.pool.check()
    assert seen["eager"] == seen["static"]


def test_static_inputs_skip_unchanged_copies(tiny_ckpt):
    """The static path copies the query starts and page table only when they change (decode steps mostly reuse
    them), and the ids of device-fed rows not at all: after every run the buffers still hold each chunk's starts and
    pages, and the tokens are the plain path's."""
    prompts = _prompts(3, seed=9)
    ref = _gen(make_engine(tiny_ckpt, page_size=16), prompts)
    engine = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4, prefill_graph_max_tokens=512)
    engine.runner.capture_graphs(1, engine.max_model_len, use_graphs=False)
    graphs = engine.runner.graphs
    copies, skips = [], []
    write = graphs._write

    def counted(name, view, values):
        (skips if graphs._last.get(name) == (view.shape, values) else copies).append(name)
        write(name, view, values)

    graphs._write = counted
    orig = graphs.run

    def checked(key, decode, prefill, *a):
        out = orig(key, decode, prefill, *a)
        chunks = decode + prefill
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + len(c.token_ids))
        assert graphs.query_start_loc[: len(chunks) + 1].tolist() == starts
        for i, c in enumerate(chunks):
            assert graphs.page_table[i, : len(c.pages)].tolist() == c.pages
        return out

    graphs.run = checked
    assert _gen(engine, prompts) == ref
    assert skips.count("query_start_loc") > 0 and skips.count("page_table") > 0
    assert copies.count("page_table") > 1  # pages were added, and prefill steps wrote their own


def test_decode_only_steps_take_the_graphs_argmax(tiny_ckpt, monkeypatch):
    """Greedy decode steps take the decode graph's own arg-max: no sampling call, no id copy between overlapped
    steps, the tokens read from a host ring row. A batch with a sampled request (or logprobs) samples as before.
    Tokens equal the plain path's either way."""
    from mlaserve.engine import loop as engine_mod
    from mlaserve.engine.cuda_graph import HOST_RING

    prompts = _prompts(3, seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cases = {
        "greedy": [greedy] * 3,
        "sampled": [greedy, SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True), greedy],
        "logprobs": [greedy, SamplingParams(temperature=0, logprobs=0, max_tokens=12, ignore_eos=True), greedy],
    }
    for name, params in cases.items():
        outs = {}
        for mode in ("plain", "static"):
            eng = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4, prefill_graph_max_tokens=512)
            calls = {"sample": 0, "decode": 0, "ids_kept": 0}
            if mode == "static":
                eng.runner.capture_graphs(1, eng.max_model_len, use_graphs=False)
                graphs = eng.runner.graphs
                run, kept = graphs.run, graphs._are_input_ids

                def counted_run(key, d, p, *a, _run=run, _c=calls):
                    _c["decode"] += key[0] == "decode"
                    return _run(key, d, p, *a)

                def counted_kept(t, n, _kept=kept, _c=calls):
                    r = _kept(t, n)
                    _c["ids_kept"] += r
                    return r

                graphs.run, graphs._are_input_ids = counted_run, counted_kept
            real = engine_mod.sample

            def counted_sample(*a, _c=calls, _real=real, **k):
                _c["sample"] += 1
                return _real(*a, **k)

            monkeypatch.setattr(engine_mod, "sample", counted_sample)
            rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
            out = run_all(eng)
            outs[mode] = [out[r] for r in rids]
            monkeypatch.setattr(engine_mod, "sample", real)
        assert outs["static"] == outs["plain"], name
        if mode == "static" and name == "greedy":
            assert calls["decode"] > HOST_RING  # the ring went round
            assert calls["sample"] == eng.num_steps - calls["decode"]  # the prefill steps' alone
        if name != "greedy":
            assert calls["sample"] >= calls["decode"] and calls["ids_kept"] == 0
        else:
            assert calls["ids_kept"] > 0


def test_packed_input_regions_are_disjoint(tiny_ckpt):
    """Each graph's packed inputs (positions, KV slots, lengths and ring row) have a region of their own, 16-byte
    aligned, and a fill writes only its graph's region: a graph replayed on its last inputs (a benchmark's replay
    loop) never reads another graph's values (shared layouts once let a batch-32 graph read a smaller one's lengths
    as slots)."""
    from mlaserve.attention.base import SeqChunk
    from mlaserve.engine.suffix import suffix_rows
    from mlaserve.kernel_config import KernelConfig

    kernels = KernelConfig(absorbed_suffix=True)  # the suffix graphs' regions too
    engine = make_engine(tiny_ckpt, page_size=16, max_num_seqs=32, prefill_graph_max_tokens=512, kernels=kernels)
    engine.runner.capture_graphs(1, engine.max_model_len, use_graphs=False)
    gr = engine.runner.graphs
    spans = []
    for key in gr._keys():
        pos, slots, lens = gr._views(key)
        assert all(t.data_ptr() % 16 == 0 for t in (pos, slots, lens)), key
        spans.append((pos.data_ptr(), lens.data_ptr() + 4 * lens.numel(), key))
    spans.sort()
    assert all(e0 <= s1 for (_, e0, _), (s1, _, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= gr.packed.data_ptr() + 8 * gr.packed.numel()
    for key in gr._keys():
        before = gr.packed.clone()
        g = gr.graphs[key]
        n = 3 if key[0] == "decode" else 40
        chunks = [
            SeqChunk(
                list(range(1, n + 1)) if key[0] == "prefill" else [7],
                0 if key[0] == "prefill" else 20,
                [5, 6, 9],
                "last",
            )
            for _ in range(min(3, g.n_reqs - 1))
        ]
        if key[0] == "suffix":  # suffix rows of 32 tokens, padding first (engine/suffix.py)
            chunks = suffix_rows([SeqChunk([7] * 5, 40, [5, 6, 9], "last")] * min(3, g.n_reqs))
        gr._ring = 2
        gr._fill(key, g, chunks)
        o, w = gr._offset[key], gr._words(*gr._sizes(key))
        changed = (gr.packed != before).nonzero().flatten().tolist()
        assert changed and all(o <= i < o + w for i in changed), key
        pos, slots, lens = gr._views(key)
        assert lens[: len(chunks)].tolist() == [c.num_cached + len(c.token_ids) for c in chunks]
        if g.ring_row is not None:
            assert g.ring_row.tolist() == [2]


def test_eager_decode_steps_are_planned_as_their_graph_twins(tiny_ckpt):
    """Without graphs, a decode-only step of n requests is planned for the decode graph it would pad to
    (ForwardBatch.plan_decode_reqs, read by the MLA decode's split plan), so an eager engine and a graphed one
    compute its rows alike; steps with prefill rows keep their own size. Every MoE block gets the planned tokens
    (ForwardBatch.plan_tokens: the quantized experts choose their kernels by it)."""
    from mlaserve.models.deepseek_v3 import DeepseekV3MoE

    engine = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4)
    model = engine.runner.model
    seen, moe_seen = [], []
    forward = model.forward
    model.forward = lambda ids, pos, batch: (
        seen.append((batch.num_decode_reqs, len(batch.query_lens_cpu), batch.plan_decode_reqs)),
        forward(ids, pos, batch),
    )[1]
    moes = [m for m in model.modules() if isinstance(m, DeepseekV3MoE)]
    assert moes
    for m in moes:
        m.forward = lambda x, *a, _f=m.forward, **k: (moe_seen.append((x.shape[0], a[2])), _f(x, *a, **k))[1]
    _gen(engine, _prompts(3))
    decode_only = {(nd, plan) for nd, reqs, plan in seen if nd == reqs}
    assert (3, 4) in decode_only and all(plan == {1: 1, 2: 2, 3: 4, 4: 4}[nd] for nd, plan in decode_only)
    assert all(plan == 0 for nd, reqs, plan in seen if nd != reqs)
    assert (3, 4) in moe_seen and all(planned >= tokens for tokens, planned in moe_seen)


def _staggered(engine, prompts, gap=3):
    """Each prompt added `gap` steps after the one before, so its prefill shares a step with the others' decode
    rows -> each request's tokens, in prompt order."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out, rids = {}, []
    for p in prompts:
        rids.append(engine.add_request(p, sp))
        for _ in range(gap):
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    for rid, toks in run_all(engine).items():
        out.setdefault(rid, []).extend(toks)
    return [out[r] for r in rids]


@pytest.mark.parametrize("spec_k", [0, 2])
def test_mixed_step_runs_as_two_static_forwards(tiny_ckpt, tmp_path, spec_k):
    """A step of decode (or verify) rows and a new prompt's chunk runs as the decode graph's static path, then the
    prefill graph's (runner.MIXED_SPLIT_MAX_TOKENS), and yields the plain eager engine's tokens; a chunk past the
    limit and the deterministic mode keep one forward."""
    from mlaserve.config import EngineConfig, SpecConfig
    from mlaserve.engine import runner as runner_mod
    from mlaserve.engine.engine import LLMEngine
    from mlaserve.models.make_random_draft import make_random_draft

    prompts = _prompts(4, seed=11, hi=90)
    ref = _staggered(make_engine(tiny_ckpt, page_size=16), prompts)
    spec = None
    if spec_k:
        draft = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=tiny_ckpt, dtype="float32")
        spec = SpecConfig(draft_model=draft, num_steps=spec_k)
    for limit, deterministic, want_split in [(4096, False, True), (8, False, False), (4096, True, False)]:
        eng = LLMEngine(
            EngineConfig(
                model=tiny_ckpt,
                device="cpu",
                page_size=16,
                max_num_seqs=4,
                prefill_graph_max_tokens=512,
                deterministic=deterministic,
            ),
            spec=spec,
        )
        eng.runner.capture_graphs(spec_k + 1, eng.max_model_len, use_graphs=False)
        steps = []  # per forward with both kinds of rows: the graph keys it ran
        fwd, run = eng.runner.execute_local, eng.runner.graphs.run
        keys = []
        eng.runner.graphs.run = lambda key, d, p, *a, run=run, keys=keys: (keys.append(key), run(key, d, p, *a))[1]

        def logged(decode, prefill, *a, fwd=fwd, keys=keys, steps=steps):
            keys.clear()
            out = fwd(decode, prefill, *a)
            if decode and prefill:
                steps.append(list(keys))
            return out

        eng.runner.execute_local = logged
        runner_mod.MIXED_SPLIT_MAX_TOKENS, old = limit, runner_mod.MIXED_SPLIT_MAX_TOKENS
        try:
            got = _staggered(eng, prompts)
        finally:
            runner_mod.MIXED_SPLIT_MAX_TOKENS = old
        assert got == ref, (limit, deterministic)
        assert steps, "no step mixed decode rows with a prompt's chunk"
        split = [k for k in steps if k]
        if want_split:
            assert split and all(k[0][0] == "decode" and k[1][0] == "prefill" for k in split), steps
        else:
            assert not split, steps
        eng.pool.check()


@pytest.mark.parametrize("spec_k,kv", [(0, "auto"), (2, "auto"), (0, "fp8")])
def test_chunks_over_cached_context_run_as_context_graphs(tiny_ckpt, tmp_path, spec_k, kv):
    """Prefix hits' suffixes and a long prompt's later chunks (prefill chunks over cached context) run the context
    graphs' static path (GraphRunner.key_for: a token bucket and a context bucket, the leftover context in a request
    of no tokens), alone and beside decode rows (two static forwards), and yield the eager engine's tokens with the
    same prefix cache and chunking (and KV cache dtype: an FP8 cache's context rows are dequantized); no page
    leaks."""
    from mlaserve.attention.base import SeqChunk
    from mlaserve.config import EngineConfig, SpecConfig
    from mlaserve.engine.engine import LLMEngine
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.models.make_random_draft import make_random_draft

    rng = random.Random(23)
    prefix = [rng.randrange(512) for _ in range(64)]  # four pages: a hit for every later prompt
    prompts = [prefix + [rng.randrange(512) for _ in range(rng.randrange(3, 60))] for _ in range(4)]
    prompts.append([rng.randrange(512) for _ in range(150)])  # three 64-token chunks, the later two over context
    spec = None
    if spec_k:
        draft = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=tiny_ckpt, dtype="float32")
        spec = SpecConfig(draft_model=draft, num_steps=spec_k)

    def engine(graphs: bool):
        kw = dict(model=tiny_ckpt, device="cpu", page_size=16, max_num_seqs=4, prefill_graph_max_tokens=512)
        kw["kv_cache_dtype"] = kv
        kw["kernels"] = KernelConfig(absorbed_suffix=False)  # the short suffixes too (tests/engine/test_suffix.py)
        eng = LLMEngine(EngineConfig(chunked_prefill_size=64, max_num_batched_tokens=96, **kw), spec=spec)
        if graphs:
            eng.runner.capture_graphs(spec_k + 1, eng.max_model_len, use_graphs=False)
        return eng

    def run(eng):  # the first prompt alone (it fills the prefix), the rest staggered beside its decode rows
        first = _gen(eng, prompts[:1])
        return first + _staggered(eng, prompts[1:], gap=2)

    ref_eng = engine(False)
    ref = run(ref_eng)
    eng = engine(True)
    gr = eng.runner.graphs
    assert (256, 512) in gr.context_buckets and all(t < c <= 4096 for t, c in gr.context_buckets)
    key = gr.key_for([], [SeqChunk(list(range(40)), 64, list(range(7)))])
    assert key == ("context", 256, 512)  # 64 cached + the 256 bucket's tokens fit 512
    assert gr.key_for([], [SeqChunk(list(range(40)), 300, list(range(22)))]) == ("context", 256, 768)
    assert gr.key_for([], [SeqChunk(list(range(40)), 64, list(range(7)), "all")]) is None  # prompt logprobs
    keys, mixed = [], []
    run_graph, fwd = gr.run, eng.runner.execute_local
    gr.run = lambda key, d, p, *a: (keys.append(key), run_graph(key, d, p, *a))[1]

    def logged(decode, prefill, *a):
        n = len(keys)
        out = fwd(decode, prefill, *a)
        if decode and prefill:
            mixed.append(keys[n:])
        return out

    eng.runner.execute_local = logged
    assert run(eng) == ref
    ctx = [k for k in keys if k[0] == "context"]
    assert len(ctx) >= 5, keys  # four suffixes and the long prompt's later chunks
    assert any(len(k) == 2 and k[1][0] == "context" for k in mixed), mixed  # beside decode rows: two forwards
    assert gr.static_runs["context"] == len(ctx)
    assert ref_eng.pool.hits and eng.pool.hits == ref_eng.pool.hits
    for e in (ref_eng, eng):
        e.pool.check()
        assert e.pool.num_free == e.pool.num_pages


def test_context_graph_fill_pads_the_context_to_its_bucket(tiny_ckpt):
    """A context graph's lengths sum to its context bucket exactly (the attention's static context rows): the real
    requests, the padding request (its own tokens only) and a last request of no tokens holding the rest."""
    from mlaserve.attention.base import SeqChunk

    engine = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4, prefill_graph_max_tokens=512)
    engine.runner.capture_graphs(1, engine.max_model_len, use_graphs=False)
    gr = engine.runner.graphs
    key = ("context", 256, 1024)
    g = gr.graphs[key]
    chunks = [SeqChunk([5] * 30, 100, list(range(9))), SeqChunk([6] * 12, 200, list(range(9, 23)))]
    gr._fill(key, g, chunks)
    lens = g.batch.seq_lens.tolist()
    assert len(lens) == 10 and sum(lens) == 1024 and g.batch.seq_lens_cpu == lens
    assert lens[:3] == [130, 212, 256 - 42] and lens[3:9] == [0] * 6 and lens[9] == 1024 - 130 - 212 - 214
    starts = g.batch.query_start_loc.tolist()
    assert starts[:4] == [0, 30, 42, 256] and starts[-1] == 256  # the last request has no tokens
    assert g.batch.slot_mapping[42:].eq(-1).all()  # padding tokens are not stored


def test_no_context_graphs_at_max_context_zero(tiny_ckpt):
    """--prefill-graph-max-context 0: no context graph is captured and chunks over cached context run eagerly."""
    from mlaserve.attention.base import SeqChunk

    engine = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4, prefill_graph_max_context=0)
    engine.runner.capture_graphs(1, engine.max_model_len, use_graphs=False)
    gr = engine.runner.graphs
    assert gr.context_buckets == [] and not any(k[0] == "context" for k in gr.graphs)
    assert gr.key_for([], [SeqChunk(list(range(40)), 64, list(range(7)))]) is None
    assert gr.key_for([], [SeqChunk(list(range(40)), 0, list(range(3)))]) == ("prefill", 256)


def test_prefill_buckets_step_by_a_quarter_and_context_graphs_stay_powers_of_two(tiny_ckpt):
    """A fresh prefill of 1,100 tokens pads to the 1,280 bucket and one of 2,500 to 2,560 (cuda_graph.
    PREFILL_TOKEN_BUCKETS: from 1,024 steps of 1.25x or less); a chunk over cached context keeps the power-of-two
    token buckets of the context graphs (CONTEXT_TOKEN_BUCKETS)."""
    from mlaserve.attention.base import SeqChunk

    engine = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4, prefill_graph_max_tokens=4096)
    engine.runner.capture_graphs(1, engine.max_model_len, use_graphs=False)
    gr = engine.runner.graphs
    assert gr.prefill_buckets == [256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096]
    assert {t for t, _ in gr.context_buckets} <= {256, 512, 1024, 2048}

    def key(n, cached=0):
        return gr.key_for([], [SeqChunk(list(range(n)), cached, list(range(-(-(n + cached) // 16))))])

    assert [key(n) for n in (600, 1024, 1025, 1100, 1800, 2500, 3073)] == [
        ("prefill", 768),
        ("prefill", 1024),
        ("prefill", 1280),
        ("prefill", 1280),
        ("prefill", 2048),
        ("prefill", 2560),
        ("prefill", 3584),
    ]
    assert key(1100, cached=64)[:2] == ("context", 2048)
