"""Quantized checkpoints under attention TP, moe-TP and EP (gloo ranks on CPU, fp32): TP2 with moe-TP2 or EP2 gives
one rank's greedy tokens and logits, and each rank reads from the files exactly the slices it keeps: the packed
words, FP8 values and scales of its own experts and shards, nothing of the others'."""

import pytest
import torch

from mlaserve.config import ParallelConfig
from mlaserve.distributed.launch import launch
from mlaserve.distributed.tp import RankInfo
from tests.helpers.quant_ckpt import FP8_TP, INT4_TP, make_quantized

from . import ranks
from .test_tp_parity import START, assert_same_run


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """scheme -> (path, its single-process greedy run)."""
    out = {}
    for scheme, dims in (("int4-experts", INT4_TP), ("fp8-block", FP8_TP)):
        path = make_quantized(tmp_path_factory.mktemp(scheme), scheme, seed=3, **dims)
        out[scheme] = path, ranks.greedy(ranks.load(path, RankInfo())[0])
    return out


def assert_read_only_own_slices(r: dict, scheme: str) -> None:
    """Every parameter's bytes came from the files once, no more: the quantized ones byte for byte as stored. The
    expanded FP8 kv_b_proj is read as its FP8 slice and held in the model dtype, and weight_shape is never held."""
    held, read = r["held_bytes"], r["read_bytes"]
    plain = {n: b for n, b in read.items() if "kv_b_proj" not in n and not n.endswith("weight_shape")}
    experts = {n: b for n, b in held.items() if ".experts.w" in n}  # the stacked quantized blocks
    assert sum(plain.values()) == sum(b for n, b in held.items() if "kv_b_proj" not in n)
    assert sum(b for n, b in plain.items() if ".experts." in n) == sum(experts.values())
    assert r["experts_read"] == r["experts_owned"]
    if scheme == "fp8-block":
        kv_b = [b for n, b in read.items() if "kv_b_proj" in n]  # held as fp32 (4 bytes), read as FP8 slices
        assert kv_b and sum(kv_b) == sum(b for n, b in held.items() if "kv_b_proj" in n)


@pytest.mark.parametrize("sizes", [(2, 2, 1), (2, 1, 2)], ids=["attn-tp2-moe-tp2", "attn-tp2-ep2"])
def test_tp2_matches_tp1_and_reads_only_its_slices(checkpoints, sizes):
    schemes = list(checkpoints)
    paths = [checkpoints[s][0] for s in schemes]
    results = launch(
        ParallelConfig(*sizes),
        _run_all,
        paths,
        timeout_s=300,
        collective_timeout_s=120,
        start_method=START,
    )
    for per_path in results:
        for scheme, r in zip(schemes, per_path):
            assert_same_run(r["tokens"], r["logits"], checkpoints[scheme][1])
            assert_read_only_own_slices(r, scheme)
            assert len(r["experts_owned"]) == 8 // sizes[2]


def _run_all(info, paths):
    return [ranks.parity(info, p) for p in paths]


def test_single_rank_holds_and_reads_everything(checkpoints):
    for scheme, (path, _) in checkpoints.items():
        r = ranks.parity(RankInfo(), path)
        assert_read_only_own_slices(r, scheme)
        assert r["experts_read"] == list(range(8))


def test_expanded_kv_b_is_the_dequantized_slice(checkpoints):
    """kv_b_proj's rank shard (224 of 448 rows: rank 1 starts inside a block) equals the rows of the whole."""
    path = checkpoints["fp8-block"][0]
    whole = ranks.load(path, RankInfo())[0].model.layers[0].self_attn.kv_b_proj.weight
    for rank in range(2):
        model, _ = ranks.load(path, ParallelConfig(2, 2, 1).rank_info(rank))
        part = model.model.layers[0].self_attn.kv_b_proj.weight
        torch.testing.assert_close(part, whole[224 * rank : 224 * (rank + 1)], rtol=0, atol=0)


@pytest.mark.parametrize("scheme,kw", [("int4-experts", dict(tp=2, ep_size=2)), ("fp8-block", dict(tp=2))])
def test_llm_tp2_matches_tp1_and_reports_each_ranks_bytes(checkpoints, scheme, kw):
    from mlaserve import LLM, SamplingParams

    path = checkpoints[scheme][0]
    prompts = [[5, 6, 7, 8], [100, 3], list(range(40, 70))]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, device="cpu").generate(prompts, sp, use_tqdm=False)]
    llm = LLM(path, device="cpu", on_rank_failure=lambda e: None, **kw)
    try:
        assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
        wb = llm.weight_bytes
        assert [w.rank for w in wb] == [0, 1] and wb[0].total == wb[1].total and wb[0].quantized > 0
    finally:
        llm.close()
