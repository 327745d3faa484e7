"""Through LLM: attn-tp2 with moe-tp2 and with ep2 (two gloo processes) give TP1's greedy tokens."""

import importlib.util
import random

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.types import StructuredOutput


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(512) for _ in range(rng.randrange(1, 100))] for _ in range(6)]


@pytest.fixture(scope="module")
def tp1(tiny_ckpt):
    outs = LLM(tiny_ckpt, device="cpu").generate(
        _prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "kw",
    [dict(attn_tp_size=2, moe_tp_size=2), dict(attn_tp_size=2, ep_size=2), dict(tp=2)],
    ids=["moe-tp2", "ep2", "tp2"],
)
def test_llm_tp_matches_tp1(tiny_ckpt, tp1, kw):
    llm = LLM(tiny_ckpt, device="cpu", on_rank_failure=lambda e: None, **kw)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert [o.token_ids for o in outs] == tp1
        assert llm.engine.pool.num_free == llm.engine.pool.num_pages
    finally:
        llm.close()


def test_llm_refuses_sizes_that_do_not_divide(tiny_ckpt):
    with pytest.raises(ValueError, match="num_attention_heads|heads"):
        LLM(tiny_ckpt, device="cpu", tp=3)


@pytest.mark.parametrize("kv_heads, sharded", [(None, True), (1, False)], ids=["split", "whole-on-rank-0"])
def test_llm_tp2_with_eagle3_matches_tp1(tiny_ckpt, tp1, tmp_path, kv_heads, sharded):
    """An EAGLE3 draft under TP2: split over the ranks where its heads divide by 2 (every rank runs each draft step
    with rank 0), else whole on rank 0 (a whole embedding, no collectives). Either way one rank's outputs and, after
    every step, the drafts one rank's engine drafts at that length."""
    from mlaserve.models.make_random_draft import make_random_draft
    from tests.helpers.engine_drive import drafts_by_length

    over = {"num_key_value_heads": kv_heads} if kv_heads else None
    draft = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=tiny_ckpt, dtype="float32", overrides=over)
    spec = {"draft_model": draft, "num_steps": 2}
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(tiny_ckpt, device="cpu", speculative_config=spec)
    out1, drafts1 = drafts_by_length(one.engine, _prompts(), sp)
    whole = {n: t.shape for n, t in one.engine.proposer.draft.named_parameters()}
    one.close()
    llm = LLM(tiny_ckpt, device="cpu", tp=2, on_rank_failure=lambda e: None, speculative_config=spec)
    try:
        p = llm.engine.proposer
        assert (p.followers is llm.engine.runner) is sharded
        mine = {n: t.shape for n, t in p.draft.named_parameters()}
        split = sorted(n for n in whole if mine[n] != whole[n])
        if sharded:  # q/k/v/o, the MLP, the lm_head and the target's embedding: this rank's halves
            assert {n.split(".")[-2] for n in split} >= {"q_proj", "k_proj", "o_proj", "down_proj", "lm_head"}, split
        else:
            assert split == [], split
        out2, drafts2 = drafts_by_length(llm.engine, _prompts(), sp)
        assert out1 == out2 == tp1
        assert drafts2 == drafts1 and len(drafts1) >= 40
    finally:
        llm.close()


def _tp2_on_the_graph_path(tiny_ckpt, **kw):
    """A TP2 LLM whose ranks take the graph runner's path, run eagerly on the CPU (use_graphs=False) -> (llm, its
    workers)."""
    llm = LLM(
        tiny_ckpt,
        device="cpu",
        tp=2,
        max_num_seqs=8,
        prefill_graph_max_tokens=512,
        on_rank_failure=lambda e: None,
        **kw,
    )
    llm.engine.runner.capture_graphs(1, llm.engine.max_model_len, use_graphs=False)
    return llm, llm._workers


def test_llm_tp2_on_the_graph_path_matches_tp1(tiny_ckpt, tp1):
    """Every rank takes the graph runner's path (run eagerly on the CPU: use_graphs=False), its decode graphs ending
    with the greedy arg-max into their own input ids and host ring: rank 0 samples from it, and the follower runs the
    same graphs."""
    llm, workers = _tp2_on_the_graph_path(tiny_ckpt)
    try:
        runner = llm.engine.runner
        assert runner.graphs.greedy
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert [o.token_ids for o in outs] == tp1
        steps = llm.engine.num_steps
        assert runner.graph_steps == steps  # six prompts of < 100 tokens: every step fits a graph
    finally:
        llm.close()
    assert workers.results == {1: f"rank 1: {steps} steps, {runner.graph_steps} by the graph runner"}


def test_tp2_prefix_hit_suffixes_on_the_suffix_graphs(tiny_ckpt):
    """Under TP2 on the graph path (eagerly on the CPU), prefix hits' short suffixes go out as SUFFIX steps: every
    rank runs them on the suffix graphs' static path (absorbed decode rows, engine/suffix.py), and the tokens are
    one rank's."""
    rng = random.Random(9)
    prefix = [rng.randrange(512) for _ in range(128)]  # two whole 64-token pages: each suffix is all new tokens
    prompts = [prefix] + [prefix + [rng.randrange(512) for _ in range(n)] for n in (3, 20, 32, 70)]  # 70: three rows
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one = LLM(tiny_ckpt, device="cpu", max_num_seqs=8)
    ref = [one.generate([p], sp, use_tqdm=False)[0].token_ids for p in prompts]
    one.close()
    llm, workers = _tp2_on_the_graph_path(tiny_ckpt)  # suffix rows are on by default
    try:
        runner = llm.engine.runner
        assert [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p in prompts] == ref
        assert runner.graphs.static_runs["suffix"] == 4, runner.graphs.static_runs
        steps = llm.engine.num_steps
    finally:
        llm.close()
    assert workers.results == {1: f"rank 1: {steps} steps, {runner.graph_steps} by the graph runner"}


def test_tp2_eager_twins_and_mixed_steps_on_the_graph_path(tiny_ckpt):
    """Under TP2 on the graph path (eagerly on the CPU), the warm-up's eager twins of graphed steps run eagerly on
    every rank (EAGER step messages), and a step of decode rows and a new prompt's chunk runs as two graphs on every
    rank: a staggered workload gives one rank's tokens, and the follower ran what rank 0 ran."""
    from mlaserve.engine.warmup import WarmupStep, warm_up
    from tests.engine.test_graph_static_path import _staggered

    prompts = [p for p in _prompts() if len(p) > 20][:4]
    one = LLM(tiny_ckpt, device="cpu", max_num_seqs=8)
    ref = _staggered(one.engine, prompts)
    one.close()
    llm, workers = _tp2_on_the_graph_path(tiny_ckpt)
    try:
        runner = llm.engine.runner
        calls = []  # per forward: (decode rows, prefill rows, eager, graph forwards it ran)
        run_local = runner.execute_local

        def logged(d, p, decode_tokens=None, decode_shift=None, eager=False, suffix=False):
            n = runner.graph_steps
            out = run_local(d, p, decode_tokens, decode_shift, eager, suffix)
            calls.append((bool(d), bool(p), eager, runner.graph_steps - n))
            return out

        runner.execute_local = logged
        # a mixed step (two graphs) and a chunk over cached context (a context graph), each then eagerly on both ranks
        warm_up(llm.engine, [WarmupStep(2, 1, 16, 20, 0), WarmupStep(0, 1, 0, 40, 16)])
        assert calls == [(True, True, False, 2), (True, True, True, 0), (False, True, False, 1), (False, True, True, 0)]
        assert _staggered(llm.engine, prompts) == ref
        assert any(c[:2] == (True, True) and c[3] == 2 for c in calls[4:]), calls  # mixed steps as two graphs
    finally:
        llm.close()
    assert workers.results == {1: f"rank 1: {len(calls)} steps, {runner.graph_steps} by the graph runner"}


def test_llm_tp2_replay_draft_exact_acceptance(tiny_ckpt, tp1, tmp_path):
    """Speculation that accepts under TP2: the REPLAY draft proposes TP1's recorded outputs with seeded misses, so
    the outputs are TP1's and each request's acceptance per draft position is exactly what the misses imply."""
    from mlaserve.spec.replay import write_recordings
    from tests.spec.test_replay import expected_per_position

    path = str(tmp_path / "replay.jsonl")
    write_recordings(path, zip(_prompts(), tp1))
    spec = dict(algorithm="REPLAY", num_steps=2, replay_path=path, replay_miss_rate=0.3, replay_seed=7)
    llm = LLM(tiny_ckpt, device="cpu", tp=2, on_rank_failure=lambda e: None, speculative_config=spec)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert [o.token_ids for o in outs] == tp1
        got = [list(o.usage.spec_accepted_per_position) for o in outs]
        want = [expected_per_position(p, 2, 0.3, 7, max_tokens=12) for p in _prompts()]
        assert got == want and sum(map(sum, want)) > 0, (got, want)
    finally:
        llm.close()


def test_llm_tp2_ngram_exact_acceptance(tiny_ckpt, tp1):
    """NGRAM under TP2: the lookup runs on rank 0 beside the sharded target; outputs are TP1's and each request's
    acceptance per draft position exactly the lookup rule's over them; structured output too."""
    from tests.spec.test_ngram import expected_per_position

    prompts = [p + o for p, o in zip(_prompts(), tp1)]  # each followed by its own output: a context to copy
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    xgr = importlib.util.find_spec("xgrammar") is not None
    so = StructuredOutput("regex", r"(ab|cd)+e")  # verify rows masked on rank 0 after the drafts
    sp_so = SamplingParams(temperature=0, max_tokens=30, structured=so)
    one = LLM(tiny_ckpt, device="cpu")  # one rank's outputs first: no other LLM beside a TP one in a process
    plain = [o.token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
    plain_so = [o.token_ids for o in one.generate(prompts[:2], sp_so, use_tqdm=False)] if xgr else None
    one.close()
    spec = dict(algorithm="NGRAM", num_steps=2, prompt_lookup_min=1, prompt_lookup_max=3)
    llm = LLM(tiny_ckpt, device="cpu", tp=2, on_rank_failure=lambda e: None, speculative_config=spec)
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.token_ids for o in outs] == plain
        got = [list(o.usage.spec_accepted_per_position) for o in outs]
        want = [expected_per_position(p, o, 2, 1, 3) for p, o in zip(prompts, plain)]
        assert got == want and sum(map(sum, want)) > 0, (got, want)
        assert llm.engine.pool.num_free == llm.engine.pool.num_pages
        if xgr:  # structured output: one rank's tokens
            two = [o.token_ids for o in llm.generate(prompts[:2], sp_so, use_tqdm=False)]
            assert two == plain_so and all(t[-1] in llm.engine.eos_token_ids for t in two)
    finally:
        llm.close()


def test_llm_tp2_with_the_trained_default_draft():
    """The shipped default model and its trained EAGLE3 draft (K=2) under TP2: plain TP1 decoding's greedy tokens,
    with drafts accepted for a real reason (the held-out prompts the draft's acceptance is measured on)."""
    import json
    import os

    from mlaserve.llm import default_draft_path

    with open(os.path.join(default_draft_path(), "eval_prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f][:4]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(device="cpu", dtype="float32")
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.close()
    spec = {"algorithm": "EAGLE3", "num_steps": 2}
    llm = LLM(device="cpu", dtype="float32", tp=2, on_rank_failure=lambda e: None, speculative_config=spec)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        accepted = [sum(o.usage.spec_accepted_per_position) for o in outs]
        assert sum(accepted) >= len(want) * 24 // 4, accepted  # a random draft accepts ~0
    finally:
        llm.close()


@pytest.mark.parametrize("layout", [dict(attn_tp_size=2, moe_tp_size=2), dict(attn_tp_size=2, ep_size=2)])
def test_llm_tp2_mtp_matches_tp1(tmp_path, layout):
    """MTP under TP2 (MoE-TP and EP): each rank holds its shard of the checkpoint's MTP layer and runs every draft
    step with rank 0 (the draft's collectives line up with the other rank's), fed the target's final normed hidden:
    one rank's outputs, and after every step the drafts one rank's MTP engine drafts at that length."""
    from mlaserve.models.make_random import make_random
    from tests.helpers.engine_drive import drafts_by_length

    path = make_random("tiny", str(tmp_path / "m"), seed=0, dtype="float32", progress=False, mtp=True)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    one = LLM(path, device="cpu")  # one rank's outputs first: no other LLM beside a TP one in a process
    plain = [o.token_ids for o in one.generate(_prompts(), sp, use_tqdm=False)]
    one.close()
    one = LLM(path, device="cpu", speculative_config=spec)
    out1, drafts1 = drafts_by_length(one.engine, _prompts(), sp)
    whole = {n: p.shape for n, p in one.engine.proposer.draft.named_parameters()}
    whole_bytes = one.engine.proposer.weight_bytes
    assert whole_bytes == one.engine.runner.reserve_bytes
    one.close()
    llm = LLM(path, device="cpu", on_rank_failure=lambda e: None, speculative_config=spec, **layout)
    try:
        p = llm.engine.proposer
        assert p.followers is llm.engine.runner
        shard = {n: t.shape for n, t in p.draft.named_parameters()}
        assert shard.keys() == whole.keys()
        split = [n for n in whole if shard[n] != whole[n]]
        assert any("self_attn" in n for n in split) and any("experts" in n for n in split), split
        assert any("embed_tokens" in n for n in split) and any("lm_head" in n for n in split), split
        # its bytes kept out of the KV cache's budget before it loaded: what it holds
        assert p.weight_bytes == llm.engine.runner.reserve_bytes < whole_bytes
        out2, drafts2 = drafts_by_length(llm.engine, _prompts(), sp)
        assert out1 == out2 == plain
        assert drafts2 == drafts1 and len(drafts1) >= 60
        assert llm.engine.pool.num_free == llm.engine.pool.num_pages
    finally:
        llm.close()


def _node1(path, addr, flags):
    """`mlaserve generate PATH --tp 2 --nnodes 2 --node-rank 1 ...` (a follower node) in a subprocess."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "mlaserve", "generate", path, "--prompt", "x", "--device", "cpu", "--tp", "2"]
    cmd += ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, *flags]
    env = {**os.environ, "PYTHONPATH": repo}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo, env=env)


def test_two_node_mtp_follower_node_from_the_cli(tmp_path):
    """Two nodes of one rank each, EP over the nodes: node 1 is `mlaserve generate ... --node-rank 1
    --enable-expert-parallel` with MTP (its layout and its shard of the draft from its own flags), node 0 an LLM:
    one rank's MTP outputs."""
    from mlaserve.distributed.rendezvous import free_port
    from mlaserve.models.make_random import make_random

    path = make_random("tiny", str(tmp_path / "m"), seed=0, dtype="float32", progress=False, mtp=True)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    one = LLM(path, device="cpu", speculative_config=spec)
    want = [o.token_ids for o in one.generate(_prompts(), sp, use_tqdm=False)]
    one.close()
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--enable-expert-parallel", "--speculative-algorithm", "MTP", "--speculative-num-steps", "2"]
    node1 = _node1(path, addr, flags)
    try:
        llm = LLM(
            path, device="cpu", tp=2, ep_size=2, moe_tp_size=1, nnodes=2, node_rank=0, dist_init_addr=addr,
            speculative_config=spec, on_rank_failure=lambda e: None,
        )  # fmt: skip
        try:
            assert [o.token_ids for o in llm.generate(_prompts(), sp, use_tqdm=False)] == want
        finally:
            llm.close()
        _, err = node1.communicate(timeout=120)
        assert node1.returncode == 0, err[-2000:]
    finally:
        node1.kill()


@pytest.mark.parametrize(
    "flags, msg",
    [
        (["--page-size", "16"], r"with moe_tp_size \(--moe-tp-size\) = 2 and rank 0 with 1 \(and 1 more: ep_size"),
        (["--enable-expert-parallel", "--page-size", "32"], "with page_size = 32 and rank 0 with 16:"),
        (
            ["--enable-expert-parallel", "--page-size", "16"],
            r"with the draft's KV bytes a page \(--speculative-\*\) = 0",
        ),
    ],
)
def test_two_nodes_started_differently_are_refused(tmp_path, flags, msg):
    """A follower node started with another layout, another page size, or without node 0's MTP draft: refused at
    start on both nodes, naming the field and both values (they would otherwise emit wrong tokens)."""
    from mlaserve.distributed.rendezvous import free_port
    from mlaserve.models.make_random import make_random

    path = make_random("tiny", str(tmp_path / "m"), seed=0, dtype="float32", progress=False, mtp=True)
    addr = f"127.0.0.1:{free_port()}"
    node1 = _node1(path, addr, flags)
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 1} if "draft" in msg else None
    try:
        with pytest.raises(ValueError, match=msg):
            LLM(
                path, device="cpu", tp=2, ep_size=2, moe_tp_size=1, nnodes=2, node_rank=0, dist_init_addr=addr,
                page_size=16, speculative_config=spec, on_rank_failure=lambda e: None,
            )  # fmt: skip
        _, err = node1.communicate(timeout=120)
        assert node1.returncode != 0 and "rank 1 was started with" in err, err[-2000:]
    finally:
        node1.kill()


def test_two_nodes_on_different_checkpoints_are_refused(tmp_path):
    """A follower node given another checkpoint (here one layer fewer): refused at start, naming the config field."""
    from mlaserve.distributed.rendezvous import free_port
    from mlaserve.models.make_random import make_random

    path = make_random("tiny", str(tmp_path / "a"), seed=0, dtype="float32", progress=False)
    other = make_random("tiny", str(tmp_path / "b"), seed=0, dtype="float32", progress=False, layers=2)
    addr = f"127.0.0.1:{free_port()}"
    node1 = _node1(other, addr, ["--page-size", "16"])
    try:
        with pytest.raises(ValueError, match="rank 1 was started with the model's config.json: num_hidden_layers = 2 "):
            LLM(path, device="cpu", tp=2, nnodes=2, node_rank=0, dist_init_addr=addr, page_size=16)
        node1.communicate(timeout=120)
        assert node1.returncode != 0
    finally:
        node1.kill()
