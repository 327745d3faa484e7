"""The start-up warm-up (engine/warmup.py): the step shapes it plans cover every eager step the engine can launch
(every decode count, both residues of the token count mod 16, every kernel threshold from both sides, every prefill
graph bucket), and it runs through the engine's runner and EAGLE3 draft without touching the KV pool. That it leaves
nothing to compile on a GPU: tests/gpu/test_no_jit_gpu.py."""

import pytest
import torch

from mlaserve.config import SpecConfig
from mlaserve.engine.cuda_graph import PREFILL_MAX_REQS, PREFILL_TOKEN_BUCKETS
from mlaserve.engine.warmup import DENSE_TOKENS, WarmupStep, _chunks, plan, token_edges, token_ladder, warm_up
from mlaserve.kernel_config import KernelConfig
from mlaserve.kernels.moe_config import INT4_ROW_BANDS
from mlaserve.types import SamplingParams
from tests.engine.conftest import make_engine, run_all


def test_ladder_covers_edges_buckets_and_residues():
    edges = token_edges(KernelConfig(), num_experts=64, top_k=6, n_shared=2)
    # the MoE bands of moe_config (rows per expert 16 / 32 / 64; the FP8 experts' 16 / 32) and KernelConfig's
    # thresholds
    assert {64 // 6, 16 * 64 // 6, 32 * 66 // 6, 64 * 66 // 6, 2, 32, 256} <= set(edges)
    # the INT4 experts' (INT4_ROW_BANDS rows an expert: Kimi-K2.5's 384 experts, top 8)
    kimi = set(token_edges(KernelConfig(), num_experts=384, top_k=8, n_shared=1))
    assert {r * 384 // 8 for r in INT4_ROW_BANDS} <= kimi
    ladder = token_ladder(1, 8192, edges)
    assert set(range(1, DENSE_TOKENS + 1)) <= set(ladder)
    assert {b for b in PREFILL_TOKEN_BUCKETS if b <= 8192} <= set(ladder)
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


def _width(step: WarmupStep, page_size: int, lookahead: int) -> int:
    """Page-table columns of the step's batch: its widest chunk's pages."""
    decode, prefill = _chunks(step, num_pages=1 << 20, page_size=page_size, lookahead=lookahead)
    return max(len(c.pages) for c in decode + prefill)


def _width_class(width: int) -> str:
    """How Triton specializes an int argument (the page table's row stride): equal to 1, divisible by 16, other."""
    return "1" if width == 1 else "16" if width % 16 == 0 else "other"


@pytest.mark.parametrize("q", [1, 2, 4])
def test_decode_counts_see_every_page_table_width_class(q):
    """MLA decode compiles per width class of the page table and per form, which the decode count picks in ranges of
    consecutive counts. The EAGLE3 chain's lookahead (K = q - 1 tokens past a step's) widens each chunk's pages:
    still, any two consecutive counts' steps see all three classes, and the first and last counts alone do."""
    S, page, K = 12, 64, q - 1
    steps = plan(q, S, 2048, 1024, page, 4096, lookahead=K)
    seen = {n: set() for n in range(1, S + 1)}
    for s in steps:
        if s.decode:
            seen[s.decode].add(_width_class(_width(s, page, K)))
    every = {"1", "16", "other"}
    assert seen[1] == seen[S] == every
    for n in range(1, S):
        assert seen[n] | seen[n + 1] == every, n
    for n in range(1, S + 1):  # and still both residues of the step's tokens mod 16
        assert {s.tokens % 16 == 0 for s in steps if s.decode == n and s.prefill} == {True, False}, n
    eager = plan(q, 1, 2048, 1024, page, 4096, decode_only=True, lookahead=K)  # no mixed step: decode-only ones
    assert {_width_class(_width(s, page, K)) for s in eager if s.decode} == every


def test_decode_only_steps_no_graph_holds_are_warmed(q=2):
    """Decode-only steps of more requests than the largest decode graph holds (EP's all-to-all edge cuts the graph
    sizes) run eagerly: the plan has a decode-only step for each of those counts (their exact token counts, for the
    kernels other than attention; the mixed steps beside them cover the page-table widths), and none below."""
    from types import SimpleNamespace

    from mlaserve.engine.warmup import _eager_decode_from

    S, page = 12, 64
    steps = plan(q, S, 2048, 1024, page, 4096, eager_decode_from=9, lookahead=q - 1)
    assert sorted(s.decode for s in steps if s.decode and not s.prefill) == [9, 10, 11, 12]
    assert plan(q, S, 2048, 1024, page, 4096, eager_decode_from=S + 1) == plan(q, S, 2048, 1024, page, 4096)
    assert _eager_decode_from(None) is None
    assert _eager_decode_from(SimpleNamespace(bs_list=[1, 2, 4, 8])) == 9
    assert _eager_decode_from(SimpleNamespace(bs_list=[])) == 1


class LaunchKeys:
    """Stands in for a Triton kernel: records each launch's compile key as Triton forms it, and launches nothing.
    The key: the constexprs and launch options, and for every other argument outside do_not_specialize: None, a
    tensor's dtype and whether its address is 16-byte aligned, an int equal to 1 / divisible by 16 / other."""

    def __init__(self, kernel, keys: set):
        self.name, self.names, self.keys = kernel.__name__, kernel.arg_names, keys
        # a JITFunction's, or the interpreter's (TRITON_INTERPRET=1: an InterpretedFunction keeps jit's arguments)
        dns = getattr(kernel, "do_not_specialize", None)
        dns = kernel.kwargs.get("do_not_specialize") or () if dns is None else dns
        self.dns = {kernel.arg_names[i] if isinstance(i, int) else i for i in dns}

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        spec = []
        for name, a in zip(self.names, args):
            if name in self.dns or a is None or isinstance(a, (bool, float)):
                v = a if a is None or isinstance(a, bool) else type(a).__name__
            elif isinstance(a, torch.Tensor):
                v = f"{str(a.dtype).removeprefix('torch.')}{'' if a.data_ptr() % 16 else ',aligned'}"
            else:
                v = "1" if a == 1 else "16k" if a % 16 == 0 else "int"
            spec.append(f"{name}={v}")
        self.keys.add(" ".join([self.name, *spec, *(f"{k}={v}" for k, v in sorted(kwargs.items()))]))


def test_warm_up_launches_the_mla_decode_variants_speculative_serving_does(tiny_ckpt, tmp_path_factory, monkeypatch):
    """The MLA decode launches of an EAGLE3 engine's eager steps while serving (mixed steps: verifies beside prefill
    chunks) all have a compile key that the start-up launched (the decode graphs' capture, the warm-up's steps). The
    engine runs on the CPU with the torch backend; each step's batch is also handed to the Triton backend's decode
    with the kernels replaced by LaunchKeys, in bf16 as on the GPU."""
    from mlaserve.attention.base import ForwardBatch
    from mlaserve.attention.triton_mla import TritonMLABackend
    from mlaserve.engine import warmup
    from mlaserve.kernels import mla_decode
    from mlaserve.models.make_random_draft import make_random_draft

    draft = make_random_draft("tiny-eagle3", str(tmp_path_factory.mktemp("draft")), target=tiny_ckpt, dtype="float32")
    page = 64
    eng = make_engine(
        tiny_ckpt,
        spec=SpecConfig(draft_model=draft, num_steps=1),
        max_model_len=2048,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        chunked_prefill_size=256,
        num_pages=128,
        page_size=page,
    )
    runner = eng.runner
    runner.capture_graphs(2, eng.max_model_len, use_graphs=False)  # the graphs' steps: the static path, not eager
    keys: set = set()
    for name in ("_mla_decode_split_kernel", "_mla_decode_combine_kernel"):
        monkeypatch.setattr(mla_decode, name, LaunchKeys(getattr(mla_decode, name), keys))
    mc = eng.model_config
    R, P = mc.kv_lora_rank, mc.qk_rope_head_dim
    attn = TritonMLABackend(torch.zeros(1, 2, page, R + P, dtype=torch.bfloat16), R, kernels=runner.kernels)

    def launch(batch):  # what the model's absorbed attention hands the backend: fresh q and output
        if not batch.num_decode_reqs:
            return
        Q = torch.empty(batch.num_decode_tokens, mc.num_attention_heads, R + P, dtype=torch.bfloat16)
        attn.decode(0, Q, 0.1, batch, Q.new_empty(Q.shape[0], Q.shape[1], R))

    for key, g in runner.graphs.graphs.items():  # capture
        if key[0] == "decode":
            launch(g.batch)
    monkeypatch.setattr(
        warmup, "_step", lambda r, d, p, dr, eager=False: launch(ForwardBatch.build(d, p, page, "cpu", attn))
    )
    warmup.warm_up(eng)
    start, forms = set(keys), set()
    keys.clear()

    execute = runner.execute_local

    def eager(decode, prefill, *a):
        if decode and runner.graphs.key_for(decode, prefill) is None:
            width = max(len(c.pages) for c in decode + prefill)
            forms.add((len(decode) > 3, _width_class(width)))
            launch(ForwardBatch.build(decode, prefill, page, "cpu", attn))
        return execute(decode, prefill, *a)

    monkeypatch.setattr(runner, "execute_local", eager)
    greedy = dict(temperature=0, ignore_eos=True)
    # short requests verify while a long prompt's chunks pass 1024 tokens (16 pages); then more requests than
    # max_num_seqs, the late ones prefilling beside one-page verifies; then two verifies beside a long prompt
    waves = [
        [(1, 24), (2, 24), (3, 20), (5, 24), (9, 22), (1100, 2)],
        [(n, 2 + i) for i, n in enumerate((1, 2, 3, 4, 5, 6, 7, 8, 9, 10))],
        [(1, 12), (3, 12), (700, 2)],
    ]
    for i, wave in enumerate(waves):
        for j, (n, m) in enumerate(wave):
            eng.add_request([(7 * j + i) % 500 + 1] * n, SamplingParams(max_tokens=m, **greedy))
        run_all(eng)
    # past batch 1-3's tiles (4+ programs at 4 heads), page tables of every width class; and batch 1-3's
    assert {(True, "1"), (True, "16"), (True, "other"), (False, "other")} <= forms, forms
    assert keys and keys <= start, "\n".join(sorted(keys - start))
