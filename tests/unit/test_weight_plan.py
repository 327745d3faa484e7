"""The byte plan (models/weight_bytes.py) without loading: every rank's figures equal what that rank holds once
loaded, kv_b_proj's FP8 expansion costs what its checkpoint bytes say, and the plan's lines do the fit's
arithmetic (room, KV tokens, the MTP draft's share) and say when a rank does not fit."""

import pytest
import torch

from mlaserve.config import ModelConfig, ParallelConfig
from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from mlaserve.models.make_random import make_random
from mlaserve.models.weight_bytes import WeightBytes, _size, mtp_bytes, plan_lines, weight_bytes, weight_plan
from mlaserve.models.weights import load_weights
from tests.helpers.quant_ckpt import FP8_ODD, FP8_TP, INT4_TP, make_quantized


def loaded(path, ranks, dtype=torch.float32) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(ModelConfig.from_pretrained(path), dtype=dtype, ranks=ranks)
    load_weights(model, path, progress=False)
    return model


@pytest.mark.parametrize(
    "scheme,dims,sizes",
    [("int4-experts", INT4_TP, (2, 2, 1)), ("int4-experts", {}, (2, 1, 2)), ("fp8-block", FP8_TP, (2, 2, 1))],
    ids=["int4-moe-tp2", "int4-ep2", "fp8-tp2"],
)
def test_the_plan_is_what_each_rank_holds_once_loaded(tmp_path, scheme, dims, sizes):
    path = make_quantized(tmp_path, scheme, **dims)
    cfg, par = ModelConfig.from_pretrained(path), ParallelConfig(*sizes)
    whole = weight_bytes(loaded(path, ParallelConfig(1, 1, 1).rank_info(0)))
    plan = weight_plan(cfg, par, dtype=torch.float32, moe_impl="torch")
    assert [wb.rank for wb in plan] == [0, 1]
    for r, wb in enumerate(plan):
        got = weight_bytes(loaded(path, par.rank_info(r)), r)
        assert wb == got, f"rank {r}"
        assert wb.total < whole.total and wb.quantized < whole.quantized  # a shard, not the whole model
    assert weight_bytes(loaded(path, par.rank_info(1))).rank == 0  # the rank is the caller's to say


# kv_b_proj 129 x 129: one row and one column into a second block each way
KV_B_129 = dict(
    FP8_ODD, kv_lora_rank=129, num_attention_heads=3, num_key_value_heads=3, qk_nope_head_dim=16, v_head_dim=27
)


@pytest.mark.parametrize("dims", ["odd", "tp", "129"])
def test_fp8_expansion_costs_the_checkpoints_bytes(fp8_ckpt, tmp_path, dims):
    """kv_b_proj held in the model dtype costs its bytes less the FP8 values and the block scales it stands for
    (FP8_ODD's 256 x 160, FP8_TP's 448 x 64 and 129 x 129: 2 x 2, 4 x 1 and 2 x 2 blocks)."""
    from safetensors import safe_open

    from mlaserve.models.weights import checkpoint_files

    path = fp8_ckpt if dims == "odd" else make_quantized(tmp_path, "fp8-block", **{"tp": FP8_TP, "129": KV_B_129}[dims])
    model = loaded(path, ParallelConfig(1, 1, 1).rank_info(0), dtype=torch.bfloat16)
    scales = {}
    for f in checkpoint_files(path):
        with safe_open(f, "pt") as h:
            scales |= {k: h.get_tensor(k) for k in h.keys() if k.endswith("kv_b_proj.weight_scale_inv")}
    layers = model.model.layers
    assert len(scales) == len(layers) == 3
    w = [layer.self_attn.kv_b_proj.weight for layer in layers]
    wb = weight_bytes(model)
    assert wb.expanded == sum(2 * x.numel() for x in w)
    assert wb.expanded_extra == sum(2 * x.numel() - x.numel() - s.numel() * 4 for x, s in zip(w, scales.values()))
    assert wb.expanded_what == "kv_b_proj x3"


def test_sizes_and_the_rank_bytes_line():
    sizes = (5_000_000, 12_345_000, 10**8 - 1, 10**8, 123_456_789, 1_235_000_000)
    assert [_size(n) for n in sizes] == ["5.00 MB", "12.35 MB", "100.00 MB", "0.10 GB", "0.12 GB", "1.24 GB"]
    wb = WeightBytes(3, quantized=2 * 10**9, dense=5 * 10**8, dequantized=7 * 10**9)
    assert (
        wb.line()
        == "rank 3 weights: 2.50 GB = quantized 2.00 GB (unquantized they would take 7.00 GB) + unquantized 0.50 GB"
    )
    wb = WeightBytes(0, 10**6, 10**6, expanded=4 * 10**5, expanded_extra=2 * 10**5, expanded_what="kv_b_proj x2")
    assert wb.line().endswith("+ unquantized 1.00 MB; expanded from FP8: kv_b_proj x2, 0.40 MB (+0.20 MB)")


@pytest.fixture(scope="module")
def kimi_cfg(tmp_path_factory):
    path = make_random(
        "kimi-k2.5", str(tmp_path_factory.mktemp("kimi")), layers=3, config_only=True, tokenizer=False, mtp=True
    )
    return ModelConfig.from_pretrained(path)


@pytest.mark.parametrize("mtp", [False, True])
def test_plan_lines_do_the_fits_arithmetic(kimi_cfg, mtp):
    cfg, par = kimi_cfg, ParallelConfig(2, 1, 2)
    gpu, util = 80 * 2**30, 0.85
    lines = plan_lines(cfg, par, gpu_bytes=gpu, utilization=util, mtp=mtp)
    head = "3 layers, compressed-tensors INT4, group 32, bfloat16; attn-tp 2, moe-tp 1, ep 2"
    assert lines[0] == head
    per = cfg.num_hidden_layers * cfg.kv_cache_dim * 2 + (cfg.kv_cache_dim * 2 if mtp else 0)
    extra = [mtp_bytes(cfg, par.rank_info(r)) if mtp else 0 for r in range(2)]
    if mtp:
        assert lines[1] == f"MTP draft: {_size(max(extra))} on a rank at most (its layer, sharded as the target's)"
    for wb, line in zip(weight_plan(cfg, par), lines[1 + mtp :], strict=True):
        room = util * gpu - wb.total - extra[wb.rank]
        assert room > 0
        want = f"fits, {_size(room)} left: {int(room // per):,} KV tokens of 85% of 80 GiB"
        assert line == f"{wb.line()} -> {want}"
    small = plan_lines(cfg, par, gpu_bytes=2**30, utilization=0.5)
    assert all(ln.endswith(" -> does NOT fit of 50% of 1 GiB") for ln in small[1:]) and len(small) == 3


def test_plan_lines_defaults_and_dtype(kimi_cfg):
    """An H200's 139 GiB at 90 % unless told; a float32 plan counts float32 weights, the MTP draft's too."""
    cfg, par = kimi_cfg, ParallelConfig(2, 2, 1)
    assert all(ln.endswith(" KV tokens of 90% of 139 GiB") for ln in plan_lines(cfg, par)[1:])
    lines = plan_lines(cfg, par, dtype=torch.float32, mtp=True)
    assert lines[0].endswith(", float32; attn-tp 2, moe-tp 2, ep 1")
    draft = max(mtp_bytes(cfg, par.rank_info(r), torch.float32) for r in range(2))
    assert lines[1] == f"MTP draft: {_size(draft)} on a rank at most (its layer, sharded as the target's)"
    assert [ln.split(" -> ")[0] for ln in lines[2:]] == [wb.line() for wb in weight_plan(cfg, par, torch.float32)]


def test_mtp_bytes_count_the_layers_own_copy(tmp_path):
    """On the Triton path an FP8 MTP layer's kv_b_proj also holds its FP8 copy (W8A8 prefill), as the target's do;
    the draft's weights follow the plan's dtype."""
    path = make_random("deepseek-v3", str(tmp_path), layers=4, config_only=True, tokenizer=False, mtp=True)
    cfg = ModelConfig.from_pretrained(path)
    rows = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    assert mtp_bytes(cfg) - mtp_bytes(cfg, moe_impl="torch") == rows * cfg.kv_lora_rank
    assert mtp_bytes(cfg, dtype=torch.float32) > mtp_bytes(cfg) > mtp_bytes(cfg, ParallelConfig(2, 2, 1).rank_info(1))


def test_an_unquantized_plan_says_so(tmp_path):
    path = make_random("kimi-k2.5", str(tmp_path), layers=2, config_only=True, tokenizer=False, quantization="none")
    line = plan_lines(ModelConfig.from_pretrained(path), ParallelConfig(1, 1, 1))[0]
    assert line == "2 layers, unquantized, bfloat16; attn-tp 1, moe-tp 1, ep 1"
