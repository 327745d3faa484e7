"""Tensor parallelism under CUDA graphs on two GPUs: attn-TP2 x MoE-TP2 gives one GPU's greedy tokens (fp32), with
programmatic dependent launch on (the default, TP ranks too) and off (MLASERVE_PDL=0), and closes promptly."""

import random
import time

import pytest
import torch

from mlaserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def _greedy(ckpt, pdl, **par):
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 200))] for _ in range(8)]
    # small graphs (decode batches up to 8, prefill buckets up to 1,024 tokens): a short capture
    llm = LLM(ckpt, device="cuda", num_pages=1024, page_size=64, max_num_seqs=8, prefill_graph_max_tokens=1024, **par)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
        assert llm.engine.runner.kernels.pdl is (pdl == "1")  # the config every rank runs (EngineConfig.kernels)
    finally:
        t0 = time.time()
        llm.close()
        closed_s = time.time() - t0
    return [o.token_ids for o in outs], closed_s


@pytest.mark.parametrize("pdl", ["1", "0"])
def test_tp2_under_graphs_matches_one_gpu(tiny_ckpt, monkeypatch, pdl):
    monkeypatch.setenv("MLASERVE_PDL", pdl)  # "0": PDL off everywhere (kernels/pdl.py); the ranks inherit it
    ref, _ = _greedy(tiny_ckpt, pdl)
    got, closed_s = _greedy(tiny_ckpt, pdl, attn_tp_size=2, moe_tp_size=2)
    assert got == ref
    # live graphs holding NCCL kernels once kept the communicator's teardown waiting forever (runner.release_graphs)
    assert closed_s < 15


def test_ep2_all_to_all_steps_stay_out_of_graphs(tiny_ckpt):
    """EP2 with the all-to-all from 64 tokens: the graphs hold the decode batches (up to 8) and no prefill bucket, the
    prefill steps run eagerly on the all-to-all, and the greedy tokens equal one GPU's."""
    from mlaserve.kernel_config import KernelConfig

    ref, _ = _greedy(tiny_ckpt, "1")
    got, closed_s = _greedy(tiny_ckpt, "1", attn_tp_size=2, ep_size=2, kernels=KernelConfig(moe_a2a_min_tokens=64))
    assert got == ref and closed_s < 15


@pytest.mark.parametrize("draft", ["mtp", "eagle3"])
@pytest.mark.parametrize("layout", [dict(attn_tp_size=2, moe_tp_size=2), dict(attn_tp_size=2, ep_size=2)])
def test_tp2_sharded_draft_graphs_match_one_gpu(tmp_path, layout, draft):
    """A draft split over TP2 (MTP; an EAGLE3 draft whose heads divide) with CUDA graphs: each rank captures the
    draft's graphs (its collectives inside) beside the verify graphs; greedy outputs and acceptance equal one
    GPU's (fp32)."""
    from mlaserve.models.make_random import make_random
    from mlaserve.models.make_random_draft import make_random_draft

    path = make_random("tiny", str(tmp_path / "m"), seed=0, dtype="float32", progress=False, mtp=draft == "mtp")
    if draft == "mtp":
        spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    else:
        d = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=path, dtype="float32")
        spec = {"draft_model": d, "num_steps": 2}
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 200))] for _ in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", num_pages=1024, page_size=64, max_num_seqs=8, speculative_config=spec)
    out = []
    for par in ({}, layout):
        llm = LLM(path, prefill_graph_max_tokens=1024, **kw, **par)
        try:
            got = llm.generate(prompts, sp, use_tqdm=False)
            assert llm.engine.proposer.graphs is not None and llm.engine.proposer.graphs.graphs
            assert (llm.engine.proposer.followers is not None) is bool(par)
            out.append(([o.token_ids for o in got], [list(o.usage.spec_accepted_per_position) for o in got]))
        finally:
            llm.close()
    assert out[1] == out[0]
