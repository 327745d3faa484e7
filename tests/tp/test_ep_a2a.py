"""Expert parallelism by all-to-all (layers/moe_a2a.py), gloo ranks on CPU in fp32: the all-to-all form gives the
all-reduce form's MoE output and TP1's greedy tokens, with uneven loads (a rank with no tokens of its own, a rank
receiving none), and the selection by step size (moe_a2a_min_tokens) in the model and the graph runner."""

import random

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.config import ParallelConfig
from mlaserve.distributed.launch import launch
from mlaserve.distributed.tp import RankInfo
from mlaserve.engine.cuda_graph import a2a_edge
from mlaserve.kernel_config import KernelConfig
from mlaserve.layers.moe_a2a import destinations, token_slice, use_a2a

from . import ep_ranks, ranks
from .test_tp_parity import assert_same_run

START = "forkserver"
EP2 = ParallelConfig(2, 1, 2)


# ---- the selection and the plan, in this process ---------------------------------------------------------------
def test_selection_by_tokens_and_ep():
    ep2, tp2 = RankInfo(0, 2, 1, 2), RankInfo(0, 2, 2, 1)
    assert use_a2a(256, ep2, 256) and use_a2a(9000, ep2, 256) and not use_a2a(255, ep2, 256)
    assert use_a2a(1, ep2, 0)
    assert not use_a2a(10_000, ep2, None)  # off
    assert not use_a2a(10_000, tp2, 0) and not use_a2a(10_000, RankInfo(), 0)  # no EP: nothing to dispatch
    assert KernelConfig().moe_a2a_min_tokens is None  # off until measured
    with pytest.raises(ValueError, match="moe_a2a_min_tokens"):
        KernelConfig(moe_a2a_min_tokens=-1)


def test_graphs_hold_no_all_to_all_step():
    """a2a_edge: no CUDA graph is captured at or above it (the all-to-all's split sizes are read on the host)."""
    k = KernelConfig(moe_a2a_min_tokens=64)
    assert a2a_edge(RankInfo(0, 2, 1, 2), k) == 64
    assert a2a_edge(RankInfo(0, 2, 2, 1), k) == float("inf")  # moe-TP: never all-to-all
    assert a2a_edge(RankInfo(0, 2, 1, 2), KernelConfig(moe_a2a_min_tokens=None)) == float("inf")


def test_token_slices_cover_the_step_once():
    for n in (0, 1, 2, 3, 7, 64):
        for w in (2, 4):
            rows = [r for rank in range(w) for r in range(*token_slice(n, rank, w)[:2])]
            assert rows == list(range(n)), (n, w)
    assert token_slice(1, 1, 2)[:2] == (1, 1)  # rank 1 has no tokens of its own


def test_destinations_once_per_rank_and_every_moe_tp_shard():
    ids = torch.tensor([[0, 1], [4, 5], [1, 6], [3, 2]])  # 8 experts, 2 EP groups of 4
    d = destinations(ids, 4, RankInfo(0, 2, 1, 2))
    assert d.tolist() == [[True, False], [False, True], [True, True], [True, False]]
    d4 = destinations(ids, 4, RankInfo(0, 4, 2, 2))  # ranks 0, 1: group 0's two moe-TP shards; 2, 3: group 1's
    assert d4.tolist()[2] == [True, True, True, True] and d4.tolist()[1] == [False, False, True, True]


# ---- two (and four) gloo ranks ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp1_run(tiny_ckpt, tiny_variant):
    return {p: ranks.greedy(ranks.load(p, RankInfo())[0]) for p in (tiny_ckpt, tiny_variant)}


@pytest.mark.parametrize("min_tokens", [0, 5], ids=["every-step", "prefill-only"])
def test_ep2_all_to_all_matches_tp1(tiny_ckpt, tiny_variant, tp1_run, min_tokens):
    """EP2 greedy tokens and logits equal one rank's, with every step on the all-to-all, and with only the steps of
    5 or more tokens on it (the schedule's two prefill steps; its 3-token decode steps all-reduce)."""
    for path in (tiny_ckpt, tiny_variant):  # one shared expert and an odd vocab / two shared experts
        results = launch(
            EP2, ep_ranks.greedy, path, min_tokens, timeout_s=180, collective_timeout_s=60, start_method=START
        )
        layers = sum(1 for i in range(3) if i >= (1 if path == tiny_ckpt else 2))  # MoE layers of the checkpoint
        for tokens, logits, calls in results:
            assert_same_run(tokens, logits, tp1_run[path])
            assert calls == layers * (2 + ranks.DECODE_STEPS if min_tokens == 0 else 2)


@pytest.mark.parametrize(
    "sizes,bias_group",
    [((2, 1, 2), None), ((2, 1, 2), 1), ((2, 1, 2), 0), ((4, 2, 2), None)],
    ids=["ep2", "ep2-all-to-rank1", "ep2-all-to-rank0", "moe-tp2-ep2"],
)
def test_both_forms_equal_on_the_same_inputs(tiny_ckpt, sizes, bias_group):
    """The first MoE block, both forms on the same replicated tokens, against one rank's block: 1 token (rank 1 has
    none of its own), 3 (uneven slices), 37; with routing forced into one EP group, the other rank receives no rows."""
    n_tokens = (1, 3, 37)
    ref_model, _ = ranks.load(tiny_ckpt, RankInfo())
    ref_moe = ep_ranks.moe_layer(ref_model, bias_group)
    with torch.no_grad():
        want = [ref_moe(x) for x in ep_ranks.moe_inputs(ref_model, n_tokens)]
    par = ParallelConfig(*sizes)
    results = launch(
        par,
        ep_ranks.moe_forms,
        tiny_ckpt,
        n_tokens,
        bias_group,
        timeout_s=180,
        collective_timeout_s=60,
        start_method=START,
    )
    for rank, per_step in enumerate(results):
        ep_rank = rank // par.moe_tp_size
        for n, w, got in zip(n_tokens, want, per_step):
            torch.testing.assert_close(got["all_reduce"], w, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["a2a"], got["all_reduce"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["a2a"], results[0][n_tokens.index(n)]["a2a"], rtol=0, atol=0)  # replicated
            if bias_group is not None:
                assert got["received"] == (n if ep_rank == bias_group else 0), (rank, n)
            else:
                assert got["received"] <= n


# ---- through LLM: the engine's selection with the graph runner's static path -----------------------------------
def _prompts():
    rng = random.Random(3)
    return [[rng.randrange(512) for _ in range(rng.randrange(1, 60))] for _ in range(5)]


def test_llm_ep2_graph_path_keeps_all_to_all_steps_eager(tiny_ckpt):
    """min_tokens 24: the graph runner keeps every decode graph (5 requests) and drops the prefill buckets (>= 256 >
    24); the prefill steps run eagerly on the all-to-all, the decode steps on the graph path; tokens equal TP1's."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_ckpt, device="cpu").generate(_prompts(), params, use_tqdm=False)]
    llm = LLM(
        tiny_ckpt,
        device="cpu",
        ep_size=2,
        attn_tp_size=2,
        max_num_seqs=8,
        prefill_graph_max_tokens=512,
        kernels=KernelConfig(moe_a2a_min_tokens=24),
        on_rank_failure=lambda e: None,
    )
    try:
        runner = llm.engine.runner
        runner.capture_graphs(1, llm.engine.max_model_len, use_graphs=False)
        assert runner.graphs.bs_list == [1, 2, 4, 8] and runner.graphs.prefill_buckets == []
        with ep_ranks.count_a2a() as calls:
            outs = llm.generate(_prompts(), params, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        assert calls and min(calls) * 2 >= 24 - 1  # each rank's slice of a step of >= 24 tokens
        assert 0 < runner.graph_steps < llm.engine.num_steps
    finally:
        llm.close()


def test_flag_sets_the_threshold_or_turns_it_off():
    import argparse

    from mlaserve.args import add_engine_args, engine_kwargs_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert "kernels" not in engine_kwargs_from_args(p.parse_args(["--ep-size", "2"]))  # the default
    kw = engine_kwargs_from_args(p.parse_args(["--ep-size", "2", "--moe-a2a-min-tokens", "1024"]))
    assert kw["kernels"].moe_a2a_min_tokens == 1024
    assert engine_kwargs_from_args(p.parse_args(["--moe-a2a-min-tokens", "off"]))["kernels"].moe_a2a_min_tokens is None
    with pytest.raises(SystemExit):
        p.parse_args(["--moe-a2a-min-tokens", "-3"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bias_group", [None, 1])
def test_nccl_both_forms_equal(tiny_ckpt, impl, bias_group):
    """The same comparison over NCCL, on the torch and the Triton MoE paths, with a step of 300 tokens too."""
    n_tokens = (1, 3, 37, 300)
    ref_model, _ = ranks.load(tiny_ckpt, RankInfo())
    ref_moe = ep_ranks.moe_layer(ref_model, bias_group)
    with torch.no_grad():
        want = [ref_moe(x) for x in ep_ranks.moe_inputs(ref_model, n_tokens)]
    args = (tiny_ckpt, n_tokens, bias_group, "cuda", impl)
    results = launch(EP2, ep_ranks.moe_forms, *args, device="cuda", timeout_s=300, collective_timeout_s=120)
    tol = dict(rtol=1e-5, atol=1e-5) if impl == "torch" else dict(rtol=2e-3, atol=2e-3)  # Triton: tf32 dots
    for rank, per_step in enumerate(results):
        for n, w, got in zip(n_tokens, want, per_step):
            torch.testing.assert_close(got["all_reduce"], w, **tol)
            torch.testing.assert_close(got["a2a"], w, **tol)
            torch.testing.assert_close(got["a2a"], results[0][n_tokens.index(n)]["a2a"], rtol=0, atol=0)
            if bias_group is not None:
                assert got["received"] == (n if rank == bias_group else 0)
