"""Batch invariance on the GPU path (Triton kernels, CUDA graphs, overlapped decode), on the tiny model in float32:
one request run alone gives the same tokens as the same request run among others, in batches of several sizes
(so other graph buckets) and phases (its decode steps beside other requests' prefill chunks), greedy and seeded.

What this proves: for the tiny float32 model, the kernels the GPU path runs compute one request's rows the same
whatever shares its step (it passed on an H200, 2026-12-01). It does not prove it for bf16 or large models: with
dtype="bfloat16" the greedy case fails here (the "mid_decode" workload), as issue #34 reports for M1, because
reductions whose order depends on the batch (split-K, split-KV, tile choices) flip near-ties. With
deterministic=True (`--deterministic-inference`) the bf16 case is asserted too ("bf16-deterministic")."""

import random

import pytest

from mlaserve.types import SamplingParams
from tests.helpers.engine_drive import drive

pytestmark = pytest.mark.gpu
DEVICE = "cuda"

PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True),
}


def _prompts(n, seed, lo, hi):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _engine(ckpt, dtype="float32", deterministic=False):
    from mlaserve.config import EngineConfig
    from mlaserve.engine.engine import LLMEngine

    # prefix caching off: a cached prefix is another computation (deterministic inference's), not batching;
    # a 64-token chunk budget splits the long prompts over steps, so their chunks share steps with the target's decode
    cfg = EngineConfig(
        model=ckpt,
        device=DEVICE,
        dtype=dtype,
        deterministic=deterministic,
        page_size=16,
        num_pages=4096,
        max_num_seqs=16,
        max_num_batched_tokens=96,
        chunked_prefill_size=64,
        enable_prefix_caching=False,
    )
    return LLMEngine(cfg)


@pytest.mark.parametrize("kind", ["float32", "bf16-deterministic"])
@pytest.mark.parametrize("mode", list(PARAMS))
def test_request_alone_equals_request_in_mixed_batches(tiny_ckpt, mode, kind):
    params = PARAMS[mode]
    target = _prompts(1, 99, 40, 41)[0]
    short, long = _prompts(12, 5, 3, 30), _prompts(3, 6, 200, 400)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    eng = _engine(tiny_ckpt) if kind == "float32" else _engine(tiny_ckpt, "bfloat16", deterministic=True)
    steps, every = [], []  # (decode chunks, prefill chunks) of each forward: this run's, all runs'

    execute = eng.runner.execute_local

    def counted(d, p, *a, **kw):
        steps.append((len(d), len(p)))
        every.append((len(d), len(p)))
        return execute(d, p, *a, **kw)

    eng.runner.execute_local = counted

    def target_tokens(arrivals):
        steps.clear()
        evs = drive(eng, arrivals, {})
        return [t for e in evs["target"] for t in e.new_token_ids], list(steps)

    alone, seen = target_tokens({0: [("target", target, params)]})
    assert len(alone) == params.max_tokens
    workloads = {
        # all at once: the target's prefill shares its step with others', then decode batches of 9 shrinking
        "together": {0: [("target", target, params)] + [(f"s{i}", p, other) for i, p in enumerate(short[:8])]},
        # the target first, then long prompts whose 64-token chunks run beside its decode steps
        "mid_decode": {
            0: [("target", target, params)],
            3: [(f"l{i}", p, other) for i, p in enumerate(long)],
            6: [(f"s{i}", p, other) for i, p in enumerate(short[8:])],
        },
        # the target last of 13, behind long prefills: its prefill is chunked among them
        "behind": {0: [(f"l{i}", p, other) for i, p in enumerate(long)] + [("target", target, params)]}
        | {2: [(f"s{i}", p, other) for i, p in enumerate(short[:9])]},
    }
    for name, arrivals in workloads.items():
        got, seen = target_tokens(arrivals)
        assert got == alone, (name, got, alone)
        if name == "mid_decode":
            assert any(d > 0 and p > 0 for d, p in seen), seen  # decode and prefill in one forward
    sizes = {d for d, p in every if p == 0}
    assert len(sizes) >= 5, sizes  # decode steps of several batch sizes (several graph buckets)
    gr = eng.runner.graphs
    assert gr is not None and gr.graph_replays["decode"] > 0, "the graph path did not run"
