"""NGRAM speculative decoding (prompt lookup, spec/ngram.py): the lookup's rule (NgramIndex here, in plain Python,
against a brute-force search; the device rule ngram_drafts_ref against it), greedy outputs equal to plain decoding's
with acceptance where the output copies its context, overlapped steps and the step graph, and its config, flags
and errors."""

import json
import random

import pytest

from mlaserve.args import engine_kwargs_from_args
from mlaserve.cli import build_parser
from mlaserve.config import EngineConfig, SpecConfig
from mlaserve.engine.engine import LLMEngine
from mlaserve.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


class NgramIndex:
    """The rule, incrementally on the host: one context with, for each n in [lo, hi], every n-gram -> the position
    after its latest occurrence that has a token after it (so the context's own suffix matches only an earlier
    occurrence)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.tokens: list[int] = []
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}

    def extend(self, tokens: list[int]) -> None:
        toks = self.tokens
        for t in tokens:
            p = len(toks)  # t's position: the n-grams ending at p - 1 now have a continuation
            for n, m in self.after.items():
                if p >= n:
                    m[tuple(toks[p - n : p])] = p
            toks.append(t)

    def lookup(self, k: int, first=None) -> list[int] | None:
        """The k tokens after the latest earlier occurrence of the longest matching suffix of this context, or None;
        at each n, an occurrence in `first` (another sequence's index, same lo and hi) before one here."""
        toks, L = self.tokens, len(self.tokens)
        for n in range(min(self.hi, L), self.lo - 1, -1):
            key = tuple(toks[L - n :])
            for idx in (first, self) if first is not None else (self,):
                j = idx.after[n].get(key)
                if j is not None:
                    run = idx.tokens[j : j + k]  # j < len(idx.tokens): at least one token
                    return run + [run[-1]] * (k - len(run))
        return None


def index(tokens, lo, hi):
    idx = NgramIndex(lo, hi)
    idx.extend(tokens[:3])
    idx.extend(tokens[3:])  # in two parts: the same as one
    return idx


def test_lookup_takes_the_longest_suffix_then_its_latest_occurrence():
    # suffix [7, 8]: at 0 followed by 1, at 4 followed by 2; suffix [6, 7, 8]: at 3 followed by 9
    toks = [7, 8, 1, 6, 7, 8, 9, 5, 7, 8, 2, 4, 6, 7, 8]
    assert index(toks, 1, 3).lookup(3) == [9, 5, 7]
    assert index(toks, 1, 2).lookup(3) == [2, 4, 6]  # the latest [7, 8] that has a token after it
    assert index(toks, 4, 5).lookup(2) is None  # [4, 6, 7, 8] occurs once: its own suffix is no match
    assert index([3, 1, 2, 3], 1, 2).lookup(4) == [1, 2, 3, 3]  # a run to the end, padded with its last token
    assert index([5], 1, 1).lookup(2) is None and NgramIndex(1, 3).lookup(1) is None


def test_lookup_equals_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(300):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        hi, k = lo + rng.randrange(3), rng.randrange(1, 5)
        want = None
        for n in range(min(hi, len(toks)), lo - 1, -1):
            ends = [j for j in range(n, len(toks)) if toks[j - n : j] == toks[len(toks) - n :]]
            if ends:
                run = toks[ends[-1] : ends[-1] + k]
                want = run + [run[-1]] * (k - len(run))
                break
        assert index(toks, lo, hi).lookup(k) == want, (toks, lo, hi, k)


def test_device_rule_equals_the_index():
    """ngram_drafts_ref (the rule the device runs: append a verify's tokens at each row's position, then look up in
    the prediction and the context) against NgramIndex over the same context and prediction: random rows in one
    batch with padding rows between, shifts, and tokens left in the rows past each context by earlier steps."""
    import torch

    from mlaserve.spec.ngram import ngram_drafts_ref

    rng = random.Random(3)
    for trial in range(100):
        lo, V = rng.randrange(1, 4), rng.choice([2, 3, 4])
        hi, k, S = lo + rng.randrange(5), rng.randrange(1, 5), 6
        C = rng.choice([64, 42])  # 42: the longest contexts end where a verify's tokens no longer fit the row
        N = k + 1
        hist = torch.randint(0, V, (S, C), dtype=torch.int32)  # stale tokens past each context
        pred, pred_lens = torch.randint(0, V, (S, 40), dtype=torch.int32), torch.zeros(S, dtype=torch.int64)
        rows, want, matched = [], [], 0
        for b in range(5):
            if b == 2:
                rows.append((-1, 0, 0, 0, [0] * N))  # a padding row
                want.append([0] * k)
                continue
            slot, ctx = b if b < 2 else b + 1, [rng.randrange(V) for _ in range(rng.randrange(N + 3, 40))]
            acc, shift = rng.randrange(N), rng.randrange(3)
            head = ctx[: len(ctx) - acc - 1]  # the context before the step's emitted tokens
            hist[slot, : len(head)] = torch.tensor(head, dtype=torch.int32)
            p = []
            if b % 2:  # random, one token, or a piece of the context (long matches in both)
                i = rng.randrange(len(ctx))
                p = rng.choice([[rng.randrange(V) for _ in range(rng.randrange(0, 30))], [ctx[-1]], ctx[i : i + 30]])
            pred[slot, : len(p)] = torch.tensor(p or [0], dtype=torch.int32)[: len(p)]
            pred_lens[slot] = len(p)
            y = ctx[len(head) :] + [rng.randrange(V) for _ in range(N - acc - 1)]
            rows.append((len(head) - 1 - shift, shift, slot, acc, y))  # the host's base, then the device's shift
            idx, first = NgramIndex(lo, hi), None
            idx.extend(ctx)
            if p:
                first = NgramIndex(lo, hi)
                first.extend(p)
            found = idx.lookup(k, first)
            matched += found is not None
            want.append(found or [ctx[-1]] * k)
        base, shift, slots, acc, y = (torch.tensor(list(c), dtype=torch.int64) for c in zip(*rows))
        counts = torch.zeros(2, dtype=torch.int64)
        before = hist.clone()
        got = ngram_drafts_ref(hist, pred, pred_lens, slots, base, acc, y, k, lo, hi, counts, shift=shift)
        assert got.tolist() == want, trial
        assert counts.tolist() == [4 * k, matched * k]  # the padding row counts nothing
        for b0, sh, slot, _, yb in rows:  # each row took its tokens, within the row, alone
            if b0 >= 0:
                start = b0 + sh + 1
                before[slot, start : start + N] = torch.tensor(yb, dtype=torch.int32)[: C - start]
        assert torch.equal(hist, before), trial
    # a longer match in the context beats a shorter one in the prediction: [1, 2, 3, 4] then 9 against [2, 3, 4] then 7
    ctx, p = [1, 2, 3, 4, 9, 5, 5, 1, 2, 3, 4], [6, 2, 3, 4, 7, 7]
    hist, pred = torch.zeros(1, 32, dtype=torch.int32), torch.zeros(1, 32, dtype=torch.int32)
    hist[0, : len(ctx)], pred[0, : len(p)] = torch.tensor(ctx), torch.tensor(p)
    one = torch.tensor([0])
    for hi, want in ((4, [9, 5]), (3, [7, 7])):  # at most 3 tokens: both match 3, the prediction first
        y = torch.tensor([[ctx[-1]] * 3])
        got = ngram_drafts_ref(
            hist,
            pred,
            torch.tensor([len(p)]),
            one,
            torch.tensor([len(ctx) - 2]),
            one,
            y,
            2,
            1,
            hi,
            torch.zeros(2, dtype=torch.int64),
        )
        assert got.tolist() == [want], hi


def run(engine, prompts, params=GREEDY):
    return run_counted(engine, prompts, [params] * len(prompts))[0]


def run_counted(engine, prompts, params):
    """-> (each request's tokens, its acceptance per draft position from its last event's usage)."""
    rids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    out, last = {r: [] for r in rids}, {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            last[o.request_id] = o
    return [out[r] for r in rids], [list(last[r].usage.spec_accepted_per_position) for r in rids]


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_ckpt):
    """Random prompts, then the same prompts followed by their own greedy continuation (a context to copy
    from), and plain greedy outputs of both (the random target's outputs also fall into loops)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(5, 60))] for _ in range(5)]
    plain = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"))
    first = run(plain, prompts)
    prompts += [p + o for p, o in zip(prompts, first)]
    return prompts, first + run(plain, prompts[5:])


def expected_per_position(prompt, out, k, lo, hi, pred=None):
    """The chain rule over the plain output: each step drafts by the lookup over prompt + out[:n] (the prompt's
    last hi - 1 tokens + pred first), accepts the drafts equal to out[n:], and emits 1 + accepted tokens, cut at
    max_tokens."""
    counts, n = [0] * k, 1  # the prefill emitted output 0
    first = index(prompt[max(0, len(prompt) - hi + 1) :] + pred, lo, hi) if pred else None
    while n < len(out):
        d = index(prompt + out[:n], lo, hi).lookup(k, first) or [out[n - 1]] * k
        a = 0
        while a < k and n + a < len(out) and d[a] == out[n + a]:
            a += 1
        emitted = min(1 + a, len(out) - n)
        for i in range(emitted - 1):
            counts[i] += 1
        n += emitted
    return counts


@pytest.mark.parametrize("k,lo,hi", [(1, 1, 3), (3, 2, 4), (2, 5, 5)])
def test_ngram_greedy_outputs_equal_plain(tiny_ckpt, prompts_and_plain, k, lo, hi):
    """Outputs equal plain decoding's, and each request's acceptance per position is exactly what the lookup rule
    gives over its plain output."""
    prompts, plain = prompts_and_plain
    spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=k, prompt_lookup_min=lo, prompt_lookup_max=hi))
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=spec)
    got, per_position = run_counted(eng, prompts, [GREEDY] * len(prompts))
    assert got == plain
    want = [expected_per_position(p, o, k, lo, hi) for p, o in zip(prompts, plain)]
    assert per_position == want
    assert sum(c[0] for c in want) > 10  # the loops and the copies are found
    st, prop, n = eng.stats(), eng.proposer, len(prompts)
    assert 0 < prop.matched_tokens < prop.proposed_tokens
    # a lookup after each prompt and each verify, and for each request at most one more: its row of the overlapped
    # step launched before the step that ended it was read back
    assert k * (st["spec_steps"] + n) <= prop.proposed_tokens <= k * (st["spec_steps"] + 2 * n)
    assert st["overlapped_steps"] > 0 and st["spec_device_steps"] == eng.loop.decode_only_steps > 0


@pytest.mark.parametrize("k", [1, 3])
def test_ngram_overlapped_and_in_the_step_graph(tiny_ckpt, prompts_and_plain, k):
    """The lookup on the device lets NGRAM steps overlap with the host and run inside the greedy step graph (run
    eagerly here): serial, overlapped and step-graph engines give plain's outputs and exactly the rule's acceptance
    per position, and leak no page."""
    prompts, plain = prompts_and_plain
    spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=k, prompt_lookup_min=1, prompt_lookup_max=3))
    want = [expected_per_position(p, o, k, 1, 3) for p, o in zip(prompts, plain)]
    for mode in ("serial", "overlapped", "step-graph"):
        cfg = EngineConfig(model=tiny_ckpt, device="cpu", page_size=16, disable_overlap_schedule=mode == "serial")
        eng = LLMEngine(cfg, spec=spec)
        if mode == "step-graph":
            eng.runner.capture_graphs(k + 1, eng.max_model_len, use_graphs=False)
            eng.capture_spec_step_graphs(use_graphs=False)
            assert eng.loop.step_graphs is eng.spec_step_graphs is not None
        step, rows_checked = eng.step, []

        def checked(
            s=step, e=eng, n=rows_checked, m=mode
        ):  # after each step every running request's row is its context
            out = s()
            for r in e.scheduler.running:
                if r.request_id in e.proposer.slot and r.output_token_ids:
                    row = e.proposer.hist[e.proposer.slot[r.request_id][1], : r.num_tokens].tolist()
                    assert row == r.prompt_token_ids + r.output_token_ids, (m, r.request_id)
                    n.append(1)
            return out

        eng.step = checked
        got, per_position = run_counted(eng, prompts, [GREEDY] * len(prompts))
        assert got == plain, mode
        assert per_position == want, mode
        assert len(rows_checked) > 50, mode
        st = eng.stats()
        assert (st["overlapped_steps"] > 0) == (mode != "serial"), mode
        runs = eng.runner.graphs.static_runs["spec_step"] if mode == "step-graph" else 0
        assert (runs > st["spec_device_steps"] // 2) == (mode == "step-graph"), (mode, runs)
        eng.pool.check()
        assert eng.pool.num_free == eng.pool.num_pages


@pytest.mark.parametrize("k", [1, 3])
def test_ngram_step_graph_with_requests_ending_and_arriving(tiny_ckpt, k):
    """Through NGRAM's step graph (run eagerly), requests that end inside a step (length, stop token, EOS, a stop
    string), arrivals and an abort mid-run: every event is the plain engine's, and no KV page leaks; the requests'
    rows are reused as they end."""
    from mlaserve.tokenizer import Tokenizer

    from ..helpers.engine_drive import assert_same_events, drive_checked, ending_mid_step, stop_string_in

    rng = random.Random(4242)
    base = [[rng.randrange(512) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    cfg = dict(model=tiny_ckpt, device="cpu", page_size=16)
    cfg_kw = dict(page_size=16, max_num_seqs=4)
    plain0 = run(LLMEngine(EngineConfig(**cfg)), base[:1], SamplingParams(temperature=0, max_tokens=24))[0]
    prompts = [p + plain0 for p in base]  # each copies a run the output then repeats: drafts get accepted
    plain0 = run(LLMEngine(EngineConfig(**cfg)), prompts[:1], SamplingParams(temperature=0, max_tokens=24))[0]
    plain1 = run(LLMEngine(EngineConfig(**cfg)), prompts[1:2], SamplingParams(temperature=0, max_tokens=24))[0]
    arrivals = ending_mid_step(prompts, plain0, 24, GREEDY)
    stop = stop_string_in(Tokenizer.from_pretrained(tiny_ckpt).decode(plain0))
    if stop:
        g = dict(temperature=0, ignore_eos=True)
        arrivals[0].append(("stop_str", prompts[0], SamplingParams(max_tokens=24, stop=[stop], **g)))
    spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=k, prompt_lookup_min=1, prompt_lookup_max=3))
    plain_runs, _ = drive_checked(tiny_ckpt, None, arrivals, plain1[5], **cfg_kw)  # "eos" ends at its 6th token
    runs, eng = drive_checked(tiny_ckpt, spec, arrivals, plain1[5], **cfg_kw)
    assert eng.runner.graphs.static_runs["spec_step"] > 0 and eng.stats()["spec_accepted_tokens"] > 0
    assert len(runs) > eng.proposer.hist.shape[0] == 4  # more requests than rows: rows taken back
    assert_same_events(plain_runs, runs, "NGRAM step graph")


@pytest.mark.parametrize("k", [1, 3])
def test_ngram_under_preemption(tiny_ckpt, prompts_and_plain, k):
    """A KV cache too small for the batch preempts requests (recomputed later: their rows rewritten, or taken back
    and given again): outputs stay plain's, and after every step each running request's next drafts are the rule's
    over its context then (a recompute's prefill emits a token without a verify, so the chain rule's counts per
    position do not apply here)."""
    prompts, plain = prompts_and_plain
    spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=k, prompt_lookup_min=1, prompt_lookup_max=3))
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu", page_size=16, num_pages=14, max_num_seqs=4), spec=spec)
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    out, checked = {r: [] for r in rids}, 0
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        for req in eng.scheduler.running:
            drafts = eng.states[req.request_id].drafts
            if drafts is not None and req.output_token_ids:
                ctx = req.prompt_token_ids + req.output_token_ids
                assert drafts == (index(ctx, 1, 3).lookup(k) or [ctx[-1]] * k), (req.request_id, ctx)
                checked += 1
    assert eng.scheduler.num_preemptions > 0 and checked > 100
    assert [out[r] for r in rids] == plain
    assert eng.pool.num_free == eng.pool.num_pages


def test_ngram_rows_hold_the_longest_context(tiny_ckpt):
    """A request's row holds the longest context the engine serves: max_model_len, else the model's
    max_position_embeddings (4096 here), at most what the KV cache holds; plus a verify's 2 N of slack."""
    spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=3, prompt_lookup_min=1, prompt_lookup_max=3))
    for kw, C in [(dict(num_pages=1024), 4096), (dict(num_pages=64), 1024), (dict(max_model_len=300), 300)]:
        eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu", page_size=16, max_num_seqs=4, **kw), spec=spec)
        assert eng.proposer.hist.shape == (4, C + 2 * 4 + 2), kw


def test_lookup_takes_the_prediction_first_at_each_n():
    ctx, pred = index([1, 2, 3, 9, 1, 2], 1, 2), index([5, 1, 2, 4, 4], 1, 2)
    assert ctx.lookup(2) == [3, 9] and ctx.lookup(2, pred) == [4, 4]
    assert index([7, 2], 1, 2).lookup(2, pred) == [4, 4]  # [7, 2] is in neither: [2] in the prediction
    assert index([1, 2, 3, 9, 1, 2], 2, 2).lookup(2, index([5, 6], 2, 2)) == [3, 9]  # no match there: the context's


def test_proposer_finds_n_grams_across_the_prompt_and_prediction_join():
    """The prediction is indexed after the prompt's last hi - 1 tokens (a prompt shorter than that whole), so the
    first output token after the prompt already finds its continuation; without a match, the last token repeated."""
    from types import SimpleNamespace

    from mlaserve.spec.ngram import NgramProposer
    from mlaserve.types import Request

    prop = NgramProposer(SimpleNamespace(num_steps=2, prompt_lookup_min=3, prompt_lookup_max=5))
    req = Request([4, 5, 6], GREEDY, prediction_token_ids=[7, 8, 9], output_token_ids=[7])
    assert prop.tokens(req) == [8, 9]
    req.output_token_ids += [8, 1]
    assert prop.tokens(req) == [1, 1] and (prop.proposed_tokens, prop.matched_tokens) == (4, 2)
    slot = prop.slot[req.request_id][1]
    req.output_token_ids += [4, 5, 6]
    assert prop.tokens(req) == [7, 8] and (prop.proposed_tokens, prop.matched_tokens) == (6, 4)
    assert prop.slot[req.request_id][1] == slot and prop.hist[slot, :9].tolist() == [4, 5, 6, 7, 8, 1, 4, 5, 6]
    four = NgramProposer(SimpleNamespace(num_steps=2, prompt_lookup_min=4, prompt_lookup_max=4))
    for prompt in ([4, 5, 6], list(range(20, 30)) + [4, 5, 6]):  # the join's 4-grams need the prompt's last 3
        req = Request(prompt, GREEDY, prediction_token_ids=[7, 8, 9], output_token_ids=[7])
        assert four.tokens(req) == [8, 9], prompt


def test_a_request_without_a_row_gets_its_context_written():
    """A verify of a request whose row was taken back (or never given: a proposer started afresh) writes the
    context the host holds before the lookup, on the launches' path and the step graph's; a request id reused by
    another request frees the first one's row."""
    from types import SimpleNamespace

    import torch

    from mlaserve.spec.ngram import NgramProposer, NgramSteps
    from mlaserve.types import Request, RequestStatus

    prop = NgramProposer(SimpleNamespace(num_steps=2, prompt_lookup_min=1, prompt_lookup_max=3), max_seqs=3)
    ctx = [4, 5, 6, 7, 4, 5, 6]
    want = index(ctx, 1, 3).lookup(2)
    reqs = [Request(ctx[:3], GREEDY, output_token_ids=ctx[3:], status=RequestStatus.RUNNING) for _ in range(2)]
    y, acc = torch.tensor([[ctx[-1]] * 3]), torch.tensor([0])
    assert want == [7, 4] and prop.propose_verified(y, acc, None, reqs[:1], starts=[len(ctx) - 2]).tolist() == [want]
    steps = NgramSteps(prop, 4)
    steps.fill_step(2, [len(ctx) - 2], reqs[1:])  # a padding row beside it
    steps.verified_inputs(torch.cat([y, y]), torch.cat([acc, acc]), None, 2)
    assert steps._forward(2).tolist()[0] == want and len(prop.free) == 1
    again = Request(ctx[:3], GREEDY, output_token_ids=ctx[3:5], status=RequestStatus.RUNNING)
    again.request_id = reqs[0].request_id  # the id of a request that ended, reused
    assert prop.tokens(again) == index(ctx[:5], 1, 3).lookup(2) and len(prop.free) == 1
    assert prop.slot[again.request_id][0] is again


def test_a_prediction_longer_than_the_row_is_cut(caplog):
    """A prediction past the prediction row (the prompt's last hi - 1 tokens and PRED_MAX more, at most a context's
    length) is looked up in its first part, with a warning naming the request."""
    from types import SimpleNamespace

    from mlaserve.spec.ngram import NgramProposer
    from mlaserve.types import Request, RequestStatus

    prop = NgramProposer(SimpleNamespace(num_steps=2, prompt_lookup_min=2, prompt_lookup_max=3), max_len=20)
    width = prop.pred.shape[1]  # 20 + 2 * 3 + 2 = 28: the prompt's last 2 tokens and 26 of the prediction
    pred = list(range(100, 160))
    req = Request([1, 2, 3], GREEDY, prediction_token_ids=pred, output_token_ids=[100], status=RequestStatus.RUNNING)
    with caplog.at_level("WARNING", logger="mlaserve.spec"):
        assert prop.tokens(req) == [101, 102]
    assert width == 28 and f"request {req.request_id}: the first 26 of its prediction's 60 tokens" in caplog.text
    req.output_token_ids += [101, 102, 103, 123, 124]  # [123, 124] just before the cut: its run stops at 125
    assert prop.tokens(req) == [125, 125]  # the row's last token, padded with itself: nothing past the cut


def test_proposer_takes_back_slots_of_requests_not_running():
    """Each request holds a row while it runs; when none is free, those of finished or preempted requests are
    taken back (a preempted one gets a row again, its context rewritten, when its prompt is computed again)."""
    from types import SimpleNamespace

    from mlaserve.spec.ngram import NgramProposer
    from mlaserve.types import Request, RequestStatus

    prop = NgramProposer(SimpleNamespace(num_steps=1, prompt_lookup_min=1, prompt_lookup_max=2), max_seqs=4)
    reqs = [Request([1, 2, 1, 9 + i], GREEDY, output_token_ids=[2]) for i in range(10)]
    for i, r in enumerate(reqs):
        r.status = RequestStatus.RUNNING
        assert prop.tokens(r) == [1]
        if i % 4:  # 0, 4, 8 keep running
            r.status = RequestStatus.FINISHED if i % 2 else RequestStatus.WAITING
    held = {rid: s for rid, (_, s) in prop.slot.items()}
    assert len(held) == 4 and sorted(held.values()) == [0, 1, 2, 3]
    assert all(reqs[i].request_id in held for i in (0, 4, 8, 9))
    for r in reqs:
        if r.request_id in held:
            assert prop.hist[held[r.request_id], :5].tolist() == r.prompt_token_ids + r.output_token_ids
    reqs[9].status = RequestStatus.RUNNING
    extra = Request([5, 5], GREEDY, output_token_ids=[5], status=RequestStatus.RUNNING)
    with pytest.raises(RuntimeError, match="NGRAM: more running requests than its 4 slots"):
        prop.tokens(extra)


@pytest.mark.parametrize("k", [1, 3])
def test_prediction_drafts_the_predicted_output(tiny_ckpt, prompts_and_plain, k):
    """OpenAI's Predicted Outputs on an NGRAM engine: each request predicting its own plain output (as token ids,
    one with an edit in the middle) keeps greedy equal to plain, its acceptance exactly the rule's with the
    prediction looked up first, and accepts more than without a prediction; a plain engine ignores it."""
    prompts, plain = prompts_and_plain
    prompts, plain = prompts[:5], plain[:5]
    preds = [o[:20] + [7, 7, 7] + o[20:] if i == 2 else list(o) for i, o in enumerate(plain)]
    spec = SpecConfig.from_dict(dict(algorithm="NGRAM", num_steps=k, prompt_lookup_min=1, prompt_lookup_max=3))
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=spec)
    outs, got = run_counted(eng, prompts, [SamplingParams(**{**GREEDY.__dict__, "prediction": q}) for q in preds])
    assert outs == plain
    assert got == [expected_per_position(p, o, k, 1, 3, q) for p, o, q in zip(prompts, plain, preds)]
    without = [expected_per_position(p, o, k, 1, 3) for p, o in zip(prompts, plain)]
    assert sum(map(sum, got)) > 2 * sum(map(sum, without))
    assert sum(c[0] for c in got) >= 0.8 * sum(len(o) // (k + 1) for o in plain)
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"))
    assert run(eng, prompts[:1], SamplingParams(**{**GREEDY.__dict__, "prediction": preds[0]})) == plain[:1]


def test_prediction_errors(tiny_ckpt):
    for bad in ("", [], [1, -2], [1.5], {"a": 1}):
        with pytest.raises(ValueError, match="prediction: must be non-empty text or a non-empty list of token ids"):
            SamplingParams(prediction=bad)
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=SpecConfig.from_dict(dict(algorithm="NGRAM")))
    with pytest.raises(ValueError, match=r"prediction: token id 512 is outside the vocabulary \[0, 512\)"):
        eng.add_request([1, 2], SamplingParams(prediction=[3, 512]))


def test_ngram_sampled_requests_run(tiny_ckpt, prompts_and_plain):
    """Sampled requests verify their n-gram drafts by the speculative-sampling rule; a seeded one repeats."""
    prompts = prompts_and_plain[0][5:7]
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=SpecConfig.from_dict(dict(algorithm="NGRAM")))
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=3)
    a, b = run(eng, prompts, p), run(eng, prompts, p)
    assert a == b and all(len(t) == 16 for t in a)


def test_ngram_config_defaults_and_vllm_keys():
    assert SpecConfig.from_dict(dict(algorithm="NGRAM")).prompt_lookup_min == 5
    d = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert d.is_ngram and (d.prompt_lookup_min, d.prompt_lookup_max, d.num_draft_tokens) == (4, 4, 4)
    d = SpecConfig.from_dict({"method": "[ngram]", "prompt_lookup_min": 2})
    assert (d.prompt_lookup_min, d.prompt_lookup_max, d.num_steps) == (2, 2, 1)
    from mlaserve.server.api import speculative_card  # here: tests/gpu imports this module without the server

    card = speculative_card(SpecConfig.from_dict(dict(algorithm="ngram", prompt_lookup_min=1, prompt_lookup_max=3)))
    assert card["algorithm"] == "NGRAM" and not card["benchmark_only"] and card["prompt_lookup_max"] == 3


@pytest.mark.parametrize(
    "d,msg",
    [
        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min: at most prompt_lookup_max"),
        (dict(prompt_lookup_min=0), "prompt_lookup_min: an integer in"),
        (dict(prompt_lookup_min=1, prompt_lookup_max=65), "prompt_lookup_max: an integer in"),
        (dict(prompt_lookup_min=1, prompt_lookup_max=2.5), "prompt_lookup_max: an integer in"),
        (dict(draft_model="/x"), "draft_model: NGRAM drafts from the context"),
        (dict(replay_path="/x"), "replay_path: NGRAM"),
        (dict(simulate_acceptance=0.5), "simulate_acceptance: NGRAM"),
        (dict(algorithm="EAGLE3", draft_model=None, prompt_lookup_min=2), "prompt_lookup_min/max: only the NGRAM"),
        (dict(algorithm=None, method="medusa"), "method: eagle3 .* or ngram"),
    ],
)
def test_ngram_config_errors(d, msg):
    d = {"algorithm": "NGRAM", **d}
    if d["algorithm"] is None:
        del d["algorithm"]
    with pytest.raises(ValueError, match=f"speculative_config.{msg}"):
        SpecConfig.from_dict(d)


def test_ngram_cli_flags():
    argv = ["generate", "--prompt", "x", "--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3"]
    argv += ["--speculative-ngram-min-match-window-size", "2", "--speculative-ngram-max-match-window-size", "6"]
    spec = SpecConfig.from_dict(engine_kwargs_from_args(build_parser(argv).parse_args(argv))["speculative_config"])
    assert spec.is_ngram and (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_draft_tokens) == (2, 6, 4)
    argv = ["generate", "--prompt", "x", "--speculative-ngram-max-match-window-size", "6"]
    with pytest.raises(ValueError, match="for --speculative-algorithm NGRAM"):
        engine_kwargs_from_args(build_parser(argv).parse_args(argv))


def test_ngram_server_takes_openai_prediction(tiny_ckpt):
    """Through the server: a chat request predicting its reply's text (OpenAI's prediction field, both content
    forms) gets the same reply with more accepted prediction tokens in its usage; a JSON-schema response_format is
    followed; a malformed prediction is a 400 naming the field; the server ends idle with no page leaked."""
    import httpx

    from ..server.conftest import assert_idle_no_leak, start_server

    spec = dict(algorithm="NGRAM", num_steps=3, prompt_lookup_min=1, prompt_lookup_max=3)
    run_ = start_server(tiny_ckpt, speculative_config=spec)
    try:
        url = f"{run_.url}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 40, "temperature": 0}
        body |= {"ignore_eos": True, "return_token_ids": True}
        first = httpx.post(url, json=body, timeout=60).json()
        text = first["choices"][0]["message"]["content"]
        parts = [{"type": "text", "text": text[:7]}, {"type": "text", "text": text[7:]}]
        for content in (text, parts):
            r = httpx.post(url, json={**body, "prediction": {"type": "content", "content": content}}, timeout=60)
            assert r.status_code == 200, r.text
            again = r.json()
            assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
            got, base = (x["usage"]["completion_tokens_details"] for x in (again, first))
            assert got["accepted_prediction_tokens"] > base["accepted_prediction_tokens"] + 10, (got, base)
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
        schema["required"] = ["n"]
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        r = httpx.post(url, json={**body, "ignore_eos": False, "response_format": fmt}, timeout=60)
        assert r.status_code == 200, r.text  # structured output under speculation: the verify rows masked
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["n"], int)
        for bad in ({"type": "content"}, {"type": "text", "content": "x"}, "x", {"type": "content", "content": [1]}):
            r = httpx.post(url, json={**body, "prediction": bad}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", (bad, r.text)
        assert_idle_no_leak(run_)
    finally:
        assert run_.stop() == 0
