"""quantization_config: the two published forms parse (top level and under Kimi-K2.5's text_config; our parse
agrees with compressed-tensors' own), and every quantization mlaserve does not compute is refused in one line
naming the field and its value."""

import copy

import pytest

from mlaserve.config import ConfigError, ModelConfig
from mlaserve.models.make_random import load_preset
from mlaserve.quantization import DEEPSEEK_FP8, KIMI_INT4, QuantConfig


def test_deepseek_fp8_at_the_top_level():
    raw = load_preset("deepseek-v3")
    raw["quantization_config"] = copy.deepcopy(DEEPSEEK_FP8)
    q = ModelConfig.from_hf(raw).quantization
    assert q.method == "fp8" and q.scheme == "fp8-block"
    L = "model.layers.3."
    for name in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj", "mlp.experts.7.down_proj"):
        assert q.quantizes(L + name), name
    assert q.quantizes("model.layers.0.mlp.gate_proj") and q.quantizes(L + "mlp.shared_experts.up_proj")
    assert not q.quantizes("lm_head") and not q.quantizes(L + "mlp.gate")  # the router is not a linear


def test_kimi_int4_under_text_config():
    raw = load_preset("kimi-k2.5")
    raw["text_config"]["quantization_config"] = copy.deepcopy(KIMI_INT4)
    cfg = ModelConfig.from_hf(raw)
    q, p = cfg.quantization, cfg.weight_prefix
    assert q.method == "int4" and p == "language_model."
    assert q.quantizes("model.layers.1.mlp.experts.0.gate_proj", p)
    assert q.quantizes("model.layers.60.mlp.experts.383.down_proj", p)
    for name in ("self_attn.q_a_proj", "self_attn.kv_b_proj", "mlp.shared_experts.down_proj"):
        assert not q.quantizes("model.layers.1." + name, p), name
    assert not q.quantizes("model.layers.0.mlp.gate_proj", p) and not q.quantizes("lm_head", p)


def test_ignore_entries_with_and_without_the_wrapper_prefix():
    qc = copy.deepcopy(KIMI_INT4)
    qc["ignore"] = ["language_model.model.layers.1.mlp.experts.0.up_proj", "re:.*experts\\.1\\..*"]
    q = QuantConfig.from_hf(qc)
    assert not q.quantizes("model.layers.1.mlp.experts.0.up_proj", "language_model.")
    assert not q.quantizes("model.layers.1.mlp.experts.1.up_proj", "language_model.")
    assert q.quantizes("model.layers.1.mlp.experts.2.up_proj", "language_model.")


def test_agrees_with_compressed_tensors():
    """compressed-tensors' QuantizationConfig reads the same scheme and matches the same modules."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.utils.match import match_name

    ref = ct.QuantizationConfig.model_validate(copy.deepcopy(KIMI_INT4))
    args = ref.config_groups["group_0"].weights
    assert (args.num_bits, args.type, args.symmetric, args.group_size, args.strategy) == (4, "int", True, 32, "group")
    ours = QuantConfig.from_hf(copy.deepcopy(KIMI_INT4))
    for name in (
        "language_model.model.layers.1.mlp.experts.0.gate_proj",
        "language_model.model.layers.1.self_attn.q_b_proj",
        "language_model.model.layers.0.mlp.down_proj",
        "language_model.model.layers.1.mlp.shared_experts.up_proj",
        "language_model.lm_head",
    ):
        ignored = any(match_name(name, pat) for pat in ref.ignore)
        assert ours.quantizes(name.removeprefix("language_model."), "language_model.") == (not ignored), name


def _with(base: dict, path: str, value) -> dict:
    d = copy.deepcopy(base)
    *keys, last = path.split(".")
    node = d
    for k in keys:
        node = node[k]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return d


W = "config_groups.group_0.weights"
REFUSED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method", "'awq'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "quant_method", "'gptq'"),
    ({"quant_method": "mxfp4"}, "quant_method", "'mxfp4'"),
    ({"quant_method": "bitsandbytes"}, "quant_method", "'bitsandbytes'"),
    ({"bits": 4}, "quant_method", "None"),
    (_with(DEEPSEEK_FP8, "weight_block_size", KeyError), "weight_block_size", "None"),  # per-tensor FP8
    (_with(DEEPSEEK_FP8, "weight_block_size", [1, 128]), "weight_block_size", "[1, 128]"),
    (_with(DEEPSEEK_FP8, "weight_block_size", [64, 64]), "weight_block_size", "[64, 64]"),
    (_with(DEEPSEEK_FP8, "activation_scheme", "static"), "activation_scheme", "'static'"),
    (_with(DEEPSEEK_FP8, "fmt", "e5m2"), "fmt", "'e5m2'"),
    (_with(DEEPSEEK_FP8, "kv_cache_quant", True), "kv_cache_quant", "True"),
    (_with(KIMI_INT4, f"{W}.num_bits", 8), f"{W}.num_bits", "8"),
    (_with(KIMI_INT4, f"{W}.num_bits", 2), f"{W}.num_bits", "2"),
    (_with(KIMI_INT4, f"{W}.symmetric", False), f"{W}.symmetric", "False"),  # zero points
    (_with(KIMI_INT4, f"{W}.group_size", 128), f"{W}.group_size", "128"),
    (_with(KIMI_INT4, f"{W}.actorder", "group"), f"{W}.actorder", "'group'"),
    (_with(KIMI_INT4, f"{W}.type", "float"), f"{W}.type", "'float'"),  # MXFP4 / NVFP4 as compressed-tensors
    (_with(KIMI_INT4, f"{W}.strategy", "channel"), f"{W}.strategy", "'channel'"),
    (_with(KIMI_INT4, f"{W}.dynamic", True), f"{W}.dynamic", "True"),
    (_with(KIMI_INT4, f"{W}.zp_dtype", "torch.int8"), f"{W}.zp_dtype", "'torch.int8'"),
    (_with(KIMI_INT4, "format", "nvfp4-pack-quantized"), "format", "'nvfp4-pack-quantized'"),
    (_with(KIMI_INT4, "format", "float-quantized"), "format", "'float-quantized'"),  # FP8 per-channel/tensor
    (_with(KIMI_INT4, "config_groups.group_0.input_activations", {"num_bits": 8}), "input_activations", "8"),
    (_with(KIMI_INT4, "kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme", "8"),
    (_with(KIMI_INT4, "quantization_status", "frozen"), "quantization_status", "'frozen'"),
    (_with(KIMI_INT4, "sparsity_config", {"format": "sparse-24"}), "sparsity_config", "sparse-24"),
    (_with(KIMI_INT4, "surprise", 1), "surprise", "1"),
    (_with(KIMI_INT4, f"{W}.surprise", 1), f"{W}.surprise", "1"),
]


@pytest.mark.parametrize("qc,field,value", REFUSED, ids=[f"{i}-{r[1]}" for i, r in enumerate(REFUSED)])
def test_refused_in_one_line_naming_field_and_value(qc, field, value):
    raw = load_preset("tiny")
    raw["quantization_config"] = qc
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(raw, "ckpt/config.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("ckpt/config.json: quantization_config.")
    assert field in msg and value in msg, msg


def test_refused_through_the_text_config_too():
    raw = load_preset("kimi-k2.5")
    raw["text_config"]["quantization_config"] = _with(KIMI_INT4, f"{W}.group_size", 64)
    with pytest.raises(ConfigError, match=r"group_size=64"):
        ModelConfig.from_hf(raw)
