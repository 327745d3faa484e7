"""make-random: deterministic for a seed, sharded with an index, honours --dtype, writes the Kimi-K2.5 wrapper,
and gives a model whose greedy output is not degenerate."""

import filecmp
import json
import os

import pytest
import torch
from safetensors import safe_open

from mlaserve.cli import main as cli_main
from mlaserve.config import ModelConfig
from mlaserve.models.make_random import hf_tensor_specs, load_preset, make_random
from tests.model import ckpt_edit
from tests.model.helpers import RefRunner, generate_greedy, load_model, make_tiny

# The tiny preset's sizes, to shrink a real preset while keeping its structure (and its RoPE).
TINY_SIZES = {
    k: load_preset("tiny")[k]
    for k in (
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "n_routed_experts",
        "num_experts_per_tok",
        "num_attention_heads",
        "num_key_value_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "vocab_size",
        "n_group",
        "topk_group",
    )
}


def files(path):
    return sorted(os.listdir(path))


def tensors_of(path) -> dict[str, tuple[str, tuple]]:
    """key -> (dtype, shape) over every shard."""
    out = {}
    for fname in files(path):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(path, fname), "pt") as h:
                for k in h.keys():
                    s = h.get_slice(k)
                    out[k] = (s.get_dtype(), tuple(s.get_shape()))
    return out


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a, b, c = (make_tiny(tmp_path / n, seed=s) for n, s in (("a", 7), ("b", 7), ("c", 8)))
    assert files(a) == files(b) == files(c)
    match, mismatch, errors = filecmp.cmpfiles(a, b, files(a), shallow=False)
    assert mismatch == [] and errors == [] and match == files(a)
    shards = [f for f in files(a) if f.endswith(".safetensors")]
    _, mismatch, _ = filecmp.cmpfiles(a, c, shards, shallow=False)
    assert mismatch == shards
    assert filecmp.cmp(os.path.join(a, "config.json"), os.path.join(c, "config.json"), shallow=False)


def test_shards_and_index(tmp_path):
    path = make_random("tiny", str(tmp_path), seed=0, dtype="float32", progress=False, shard_bytes=100_000)
    index = json.load(open(os.path.join(path, ckpt_edit.INDEX)))
    shards = [f for f in files(path) if f.endswith(".safetensors")]
    assert len(shards) >= 4 and all(f"-of-{len(shards):05d}" in f for f in shards)
    tensors = tensors_of(path)
    assert set(index["weight_map"].values()) == set(shards)
    for fname in shards:  # the index says exactly where each tensor is
        with safe_open(os.path.join(path, fname), "pt") as h:
            assert {k for k, f in index["weight_map"].items() if f == fname} == set(h.keys())
    cfg = ModelConfig.from_pretrained(path)
    assert {n: s for n, s, _ in hf_tensor_specs(cfg)} == {k: s for k, (_, s) in tensors.items()}
    nbytes = sum(4 * torch.Size(s).numel() for _, s in tensors.values())
    assert index["metadata"]["total_size"] == nbytes
    load_model(path)


def test_a_small_model_still_gets_two_shards(tiny_ckpt):
    assert len([f for f in files(tiny_ckpt) if f.endswith(".safetensors")]) == 2


@pytest.mark.parametrize("dtype,want", [("bf16", "BF16"), ("bfloat16", "BF16"), ("fp32", "F32"), ("float16", "F16")])
def test_dtype_flag(tmp_path, dtype, want):
    path = make_tiny(tmp_path, dtype=dtype)
    for key, (got, _) in tensors_of(path).items():
        # The router's correction bias stays fp32, as in the real checkpoints.
        assert got == ("F32" if key.endswith("e_score_correction_bias") else want), key
    cfg = ckpt_edit.read_config(path)
    assert cfg["torch_dtype"] == {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}[want]
    size = {"BF16": 2, "F32": 4, "F16": 2}
    index = json.load(open(os.path.join(path, ckpt_edit.INDEX)))
    assert index["metadata"]["total_size"] == sum(size[d] * torch.Size(s).numel() for d, s in tensors_of(path).values())
    load_model(path, torch.bfloat16)


def test_kimi_k25_preset_writes_the_wrapper(tmp_path):
    """The real preset's structure and RoPE with the tiny sizes: config wrapper, language_model. prefix."""
    path = make_random(
        "kimi-k2.5", str(tmp_path), layers=2, seed=0, dtype="float32", progress=False, overrides=TINY_SIZES
    )
    cfg = ckpt_edit.read_config(path)
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["text_config"]["num_hidden_layers"] == 2 and cfg["text_config"]["hidden_size"] == 64
    assert cfg["text_config"]["rope_scaling"]["factor"] == 64.0
    keys = list(ckpt_edit.weight_map(path))
    assert keys and all(k.startswith("language_model.model.") or k == "language_model.lm_head.weight" for k in keys)
    model = load_model(path)
    assert model.config.weight_prefix == "language_model." and model.config.rope.type == "yarn"
    _, logits = RefRunner(model).prefill([[1, 2, 3, 4]])
    assert torch.isfinite(logits[0]).all()


def test_wrapper_option_is_a_no_op_on_a_wrapped_preset(tmp_path):
    kw = dict(layers=1, seed=0, dtype="float32", progress=False, overrides=TINY_SIZES)
    a = make_random("kimi-k2.5", str(tmp_path / "a"), **kw)
    b = make_random("kimi-k2.5", str(tmp_path / "b"), wrapper=True, **kw)
    assert filecmp.cmpfiles(a, b, files(a), shallow=False)[1] == []


def test_draft_preset_is_refused(tmp_path):
    for wrapper in (False, True):
        with pytest.raises(ValueError, match="not a DeepSeek-V3 \\(or V2\\) target"):
            make_random("kimi-k2.5-eagle3", str(tmp_path), wrapper=wrapper, progress=False)


def test_cli_writes_the_same_checkpoint(tmp_path):
    ref = make_random("tiny", str(tmp_path / "ref"), seed=3, dtype="bfloat16", progress=False, wrapper=True)
    out = str(tmp_path / "cli")
    assert cli_main(["make-random", "tiny", out, "--seed", "3", "--dtype", "bf16", "--wrapper"]) == 0
    match, mismatch, errors = filecmp.cmpfiles(ref, out, files(ref), shallow=False)
    assert mismatch == [] and errors == [] and files(out) == files(ref)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_output_is_not_degenerate(tmp_path, seed):
    """32 greedy tokens from each of a few prompts are varied, and differ between prompts: the init scales
    give a model that does not collapse onto one token."""
    model = load_model(make_tiny(tmp_path, seed=seed))
    prompts = [[256, 5, 6, 7], [256, 100], [256, 400, 401, 402, 403, 404], [256]]
    tokens, logits = generate_greedy(RefRunner(model, num_pages=256), prompts, 32)
    for t in tokens:
        assert len(set(t)) >= 16, t
    assert len({tuple(t) for t in tokens}) == len(prompts)
    assert logits.std(-1).min() > 1.0  # logits are not flat


def test_kimi_k25_preset_is_int4_experts_as_published(tmp_path):
    """quantization_config in text_config; each routed expert's projections as weight_packed (I32) + weight_scale
    (BF16) + weight_shape; attention, shared experts, the dense MLP and the lm_head unquantized."""
    from mlaserve.quantization import KIMI_INT4

    path = make_random("kimi-k2.5", str(tmp_path), layers=2, dtype="bfloat16", progress=False, overrides=TINY_SIZES)
    cfg = ckpt_edit.read_config(path)
    assert cfg["text_config"]["quantization_config"] == KIMI_INT4 and "quantization_config" not in cfg
    t = tensors_of(path)
    p = "language_model.model.layers.1.mlp."
    for e in range(8):
        for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
            base = f"{p}experts.{e}.{proj}."
            assert t[base + "weight_packed"] == ("I32", (shape[0], shape[1] // 8))
            assert t[base + "weight_scale"] == ("BF16", (shape[0], shape[1] // 32))
            assert t[base + "weight_shape"] == ("I64", (2,)) and base + "weight" not in t
    quantized = {k for k in t if k.endswith(("_packed", "_scale", "_shape"))}
    assert quantized == {k for k in t if ".experts." in k}
    assert t[p + "shared_experts.up_proj.weight"][0] == "BF16" and t["language_model.lm_head.weight"][0] == "BF16"
    assert load_model(path).model.layers[1].mlp.experts.w13_packed.dtype == torch.int32


def test_deepseek_v3_preset_is_fp8_as_published(tmp_path):
    """quantization_config at the top level; every linear but the lm_head FP8 e4m3 with fp32 block scales
    [ceil(out/128), ceil(in/128)]; the router, norms, embedding, correction bias and lm_head unquantized."""
    from mlaserve.quantization import DEEPSEEK_FP8

    dims = {**TINY_SIZES, "first_k_dense_replace": 1}
    path = make_random("deepseek-v3", str(tmp_path), layers=2, dtype="bfloat16", progress=False, overrides=dims)
    assert ckpt_edit.read_config(path)["quantization_config"] == DEEPSEEK_FP8
    t = tensors_of(path)
    scales = {k: v for k, v in t.items() if k.endswith("weight_scale_inv")}
    fp8 = {k: v for k, v in t.items() if v[0] == "F8_E4M3"}
    assert {k + "_scale_inv" for k in fp8} == set(scales) and len(fp8) == 2 * 5 + 3 + 3 * 8 + 3
    for k, (_, shape) in fp8.items():
        assert scales[k + "_scale_inv"] == ("F32", tuple(-(-n // 128) for n in shape)), k
    rest = {k: v[0] for k, v in t.items() if k not in fp8 and k not in scales}
    assert rest["lm_head.weight"] == rest["model.layers.1.mlp.gate.weight"] == rest["model.norm.weight"] == "BF16"
    assert rest["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    load_model(path)


def test_quantization_none_and_cli_flags(tmp_path):
    plain = make_random(
        "kimi-k2.5", str(tmp_path / "p"), layers=1, progress=False, overrides=TINY_SIZES, quantization="none"
    )
    assert "quantization_config" not in ckpt_edit.read_config(plain)["text_config"]
    out = str(tmp_path / "cli")
    assert cli_main(["make-random", "tiny", out, "--quantization", "fp8-block", "--config-only"]) == 0
    assert ckpt_edit.read_config(out)["quantization_config"]["quant_method"] == "fp8"
    assert not [f for f in files(out) if f.endswith(".safetensors")] and "tokenizer.json" in files(out)


def test_plan_prints_each_ranks_bytes(capsys):
    assert cli_main(["make-random", "kimi-k2.5", "--plan", "--layers", "3", "--tp", "2", "--ep-size", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("3 layers, compressed-tensors INT4, group 32, bfloat16; attn-tp 2, moe-tp 1, ep 2")
    assert [ln.split(" weights:")[0] for ln in lines[1:]] == ["rank 0", "rank 1"] and "fits" in lines[1]


def test_plan_with_the_mtp_draft(capsys):
    """--mtp: every rank holds its shard of the MTP layer (split as the target's layers are; the embedding and
    lm_head are the target's), and each rank's room shrinks by exactly its shard."""
    import re

    from mlaserve.config import ModelConfig, ParallelConfig
    from mlaserve.models.make_random import make_random as mr
    from mlaserve.models.weight_bytes import mtp_bytes

    assert cli_main(["make-random", "deepseek-v3", "--plan", "--layers", "4", "--tp", "2"]) == 0
    plain = capsys.readouterr().out.strip().splitlines()
    assert cli_main(["make-random", "deepseek-v3", "--plan", "--layers", "4", "--tp", "2", "--mtp"]) == 0
    mtp = capsys.readouterr().out.strip().splitlines()
    assert mtp[1].startswith("MTP draft: ") and len(mtp) == len(plain) + 1

    def left(line):
        return float(re.search(r"fits, ([\d.]+) GB left", line).group(1))

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg = ModelConfig.from_pretrained(mr("deepseek-v3", tmp, layers=4, config_only=True, tokenizer=False, mtp=True))
    par = ParallelConfig(attn_tp_size=2, moe_tp_size=2)
    whole = mtp_bytes(cfg)
    shards = [mtp_bytes(cfg, par.rank_info(r)) for r in range(2)]
    # halved but for what every rank holds whole (the norms, eh_proj [D, 2D], the router)
    eh_proj = 2 * cfg.hidden_size * cfg.hidden_size * 2
    assert all(abs(s - (whole + eh_proj) / 2) < 0.01 * whole for s in shards), (whole, shards)
    for r in range(2):
        assert abs(left(plain[1 + r]) - left(mtp[2 + r]) - shards[r] / 1e9) < 0.02
