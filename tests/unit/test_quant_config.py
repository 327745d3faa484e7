"""quantization_config: the two published forms parse (top level and under Kimi-K2.5's text_config; our parse
agrees with compressed-tensors' own), and every quantization mlaserve does not compute is refused in one line
naming the field and its value."""

import copy

import pytest

from mlaserve.config import ConfigError, ModelConfig
from mlaserve.models.make_random import load_preset
from mlaserve.quantization import DEEPSEEK_FP8, KIMI_INT4, QuantConfig, published_config


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
G = "config_groups.group_0"
UNKNOWN_CT = "unknown field of a compressed-tensors quantization_config"
SUPPORTED = (
    "mlaserve computes 'fp8' (e4m3, 128x128 block scales) and 'compressed-tensors' (pack-quantized symmetric int4,"
    " group 32)"
)
BLOCKS = "mlaserve computes FP8 with 128x128 weight blocks (per-tensor/channel: no)"
# (quantization_config, field, value as printed, the reason after "is not supported; ")
REFUSED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method", "'awq'", SUPPORTED),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "quant_method", "'gptq'", SUPPORTED),
    ({"quant_method": "mxfp4"}, "quant_method", "'mxfp4'", SUPPORTED),
    ({"quant_method": "bitsandbytes"}, "quant_method", "'bitsandbytes'", SUPPORTED),
    ({"bits": 4}, "quant_method", "None", SUPPORTED),
    (_with(DEEPSEEK_FP8, "weight_block_size", KeyError), "weight_block_size", "None", BLOCKS),  # per-tensor FP8
    (_with(DEEPSEEK_FP8, "weight_block_size", [1, 128]), "weight_block_size", "[1, 128]", BLOCKS),
    (_with(DEEPSEEK_FP8, "weight_block_size", [64, 64]), "weight_block_size", "[64, 64]", BLOCKS),
    (
        _with(DEEPSEEK_FP8, "activation_scheme", "static"),
        "activation_scheme",
        "'static'",
        "mlaserve quantizes activations dynamically (static input scales are unused)",
    ),
    (_with(DEEPSEEK_FP8, "fmt", "e5m2"), "fmt", "'e5m2'", "mlaserve computes float8 e4m3 weights"),
    (
        _with(DEEPSEEK_FP8, "kv_cache_quant", True),
        "kv_cache_quant",
        "True",
        "unknown field of an fp8 quantization_config",
    ),
    (_with(KIMI_INT4, f"{W}.num_bits", 8), f"{W}.num_bits", "8", "mlaserve computes 4-bit weights"),
    (_with(KIMI_INT4, f"{W}.num_bits", 2), f"{W}.num_bits", "2", "mlaserve computes 4-bit weights"),
    (_with(KIMI_INT4, f"{W}.num_bits", KeyError), f"{W}.num_bits", "8", "mlaserve computes 4-bit weights"),  # default
    (
        _with(KIMI_INT4, f"{W}.symmetric", False),
        f"{W}.symmetric",
        "False",
        "asymmetric (zero-point) int4 is not computed",
    ),
    (
        _with(KIMI_INT4, f"{W}.group_size", 128),
        f"{W}.group_size",
        "128",
        "mlaserve computes int4 with groups of 32 inputs",
    ),
    (
        _with(KIMI_INT4, f"{W}.group_size", KeyError),
        f"{W}.group_size",
        "None",
        "mlaserve computes int4 with groups of 32 inputs",
    ),
    (
        _with(KIMI_INT4, f"{W}.actorder", "group"),
        f"{W}.actorder",
        "'group'",
        "mlaserve computes int4 with actorder in [None, False]",
    ),
    (
        _with(KIMI_INT4, f"{W}.actorder", True),
        f"{W}.actorder",
        "True",
        "mlaserve computes int4 with actorder in [None, False]",
    ),
    (
        _with(KIMI_INT4, f"{W}.type", "float"),  # MXFP4 / NVFP4 as compressed-tensors
        f"{W}.type",
        "'float'",
        "mlaserve computes integer int4 weights (MXFP4/NVFP4: no)",
    ),
    (
        _with(KIMI_INT4, f"{W}.strategy", "channel"),
        f"{W}.strategy",
        "'channel'",
        "mlaserve computes int4 with strategy in ['group', None]",
    ),
    (_with(KIMI_INT4, f"{W}.dynamic", True), f"{W}.dynamic", "True", "mlaserve computes int4 with dynamic in [False]"),
    (
        _with(KIMI_INT4, f"{W}.block_structure", [128, 128]),
        f"{W}.block_structure",
        "[128, 128]",
        "mlaserve computes int4 with block_structure in [None]",
    ),
    (
        _with(KIMI_INT4, f"{W}.zp_dtype", "torch.int8"),
        f"{W}.zp_dtype",
        "'torch.int8'",
        "mlaserve computes int4 with zp_dtype in [None]",
    ),
    (
        _with(KIMI_INT4, f"{W}.scale_dtype", "torch.float16"),
        f"{W}.scale_dtype",
        "'torch.float16'",
        "mlaserve computes int4 with scale_dtype in [None, 'torch.bfloat16', 'bfloat16']",
    ),
    (_with(KIMI_INT4, W, "int4"), W, "'int4'", "expected the int4 weights' arguments"),
    (
        _with(KIMI_INT4, "format", "nvfp4-pack-quantized"),
        "format",
        "'nvfp4-pack-quantized'",
        "mlaserve computes compressed-tensors 'pack-quantized' int4",
    ),
    (
        _with(KIMI_INT4, "format", "float-quantized"),
        "format",
        "'float-quantized'",
        "mlaserve computes compressed-tensors 'pack-quantized' int4",
    ),  # FP8 per-channel/tensor
    (
        _with(KIMI_INT4, f"{G}.format", "int-quantized"),
        f"{G}.format",
        "'int-quantized'",
        "mlaserve computes 'pack-quantized' int4",
    ),
    (
        _with(KIMI_INT4, f"{G}.input_activations", {"num_bits": 8}),
        f"{G}.input_activations",
        "{'num_bits': 8}",
        "mlaserve computes weight-only int4 (activations in bf16)",
    ),
    (
        _with(KIMI_INT4, f"{G}.output_activations", {"num_bits": 8}),
        f"{G}.output_activations",
        "{'num_bits': 8}",
        "mlaserve computes weight-only int4 (activations in bf16)",
    ),
    (
        _with(KIMI_INT4, f"{G}.targets", []),
        f"{G}.targets",
        "[]",
        "expected a list of module names, 're:' patterns or 'Linear'",
    ),
    (
        _with(KIMI_INT4, f"{G}.targets", "Linear"),
        f"{G}.targets",
        "'Linear'",
        "expected a list of module names, 're:' patterns or 'Linear'",
    ),
    (_with(KIMI_INT4, G, "int4"), G, "'int4'", "expected an object"),
    (_with(KIMI_INT4, "config_groups", {}), "config_groups", "{}", "expected one or more groups of int4 weights"),
    (
        _with(KIMI_INT4, "config_groups", ["group_0"]),
        "config_groups",
        "['group_0']",
        "expected one or more groups of int4 weights",
    ),
    (_with(KIMI_INT4, "ignore", "lm_head"), "ignore", "'lm_head'", "expected a list of module names or 're:' patterns"),
    (
        _with(KIMI_INT4, "kv_cache_scheme", {"num_bits": 8}),
        "kv_cache_scheme",
        "{'num_bits': 8}",
        "the KV cache is kept in the model dtype",
    ),
    (
        _with(KIMI_INT4, "quantization_status", "frozen"),
        "quantization_status",
        "'frozen'",
        "the weights must be stored compressed",
    ),
    (
        _with(KIMI_INT4, "sparsity_config", {"format": "sparse-24"}),
        "sparsity_config",
        "{'format': 'sparse-24'}",
        "mlaserve computes plain pack-quantized weights",
    ),
    (_with(KIMI_INT4, "surprise", 1), "surprise", "1", UNKNOWN_CT),
    (_with(KIMI_INT4, f"{W}.surprise", 1), f"{W}.surprise", "1", "unknown field of int4 weight arguments"),
]


@pytest.mark.parametrize("qc,field,value,why", REFUSED, ids=[f"{i}-{r[1]}" for i, r in enumerate(REFUSED)])
def test_refused_in_one_line_naming_field_and_value(qc, field, value, why):
    raw = load_preset("tiny")
    raw["quantization_config"] = qc
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(raw, "ckpt/config.json")
    assert str(e.value) == f"ckpt/config.json: quantization_config.{field}={value} is not supported; {why}"


def test_a_quantization_config_that_is_not_an_object():
    with pytest.raises(ConfigError) as e:
        QuantConfig.from_hf(["fp8"])
    assert str(e.value) == "config.json: quantization_config must be an object, got list"


def test_fields_left_out_take_the_published_defaults():
    fp8 = {k: v for k, v in DEEPSEEK_FP8.items() if k not in ("fmt", "activation_scheme")}
    assert QuantConfig.from_hf(fp8).method == "fp8"  # e4m3, dynamic
    ct = _with(_with(KIMI_INT4, "quantization_status", KeyError), f"{W}.type", KeyError)
    for k in ("symmetric", "strategy", "actorder"):
        ct = _with(ct, f"{W}.{k}", KeyError)
    ct = _with(ct, f"{W}.actorder", False)
    ct = _with(ct, f"{W}.scale_dtype", "bfloat16")
    ct = _with(ct, "sparsity_config", {})  # empty: accepted
    assert QuantConfig.from_hf(ct).method == "int4"


def test_the_parsed_config_keeps_what_it_read():
    fp8 = dict(DEEPSEEK_FP8, ignored_layers=["model.layers.3.self_attn.o_proj"], modules_to_not_convert=["re:.*q_a.*"])
    q = QuantConfig.from_hf(fp8)
    assert q.hf == fp8 and q.ignore == ("model.layers.3.self_attn.o_proj", "re:.*q_a.*")
    assert not q.quantizes("model.layers.3.self_attn.o_proj") and not q.quantizes("model.layers.4.self_attn.q_a_proj")
    assert q.quantizes("model.layers.4.self_attn.o_proj")
    ct = copy.deepcopy(KIMI_INT4)
    assert QuantConfig.from_hf(ct).hf == KIMI_INT4
    assert QuantConfig.from_hf(ct).describe() == "compressed-tensors INT4, group 32"
    assert q.describe() == "FP8 e4m3, 128x128 block scales"


def test_targets_of_every_group_by_name_or_pattern():
    ct = _with(KIMI_INT4, f"{G}.targets", ["re:.*experts.*up_proj"])
    ct["config_groups"]["group_1"] = _with(
        ct["config_groups"]["group_0"], "targets", ["model.layers.1.mlp.experts.0.down_proj"]
    )
    q = QuantConfig.from_hf(ct)
    assert q.targets == ("re:.*experts.*up_proj", "model.layers.1.mlp.experts.0.down_proj")
    assert q.quantizes("model.layers.1.mlp.experts.3.up_proj")
    assert q.quantizes("model.layers.1.mlp.experts.0.down_proj")  # group_1's name
    assert q.quantizes("model.layers.1.mlp.experts.0.down_proj", "language_model.")
    assert not q.quantizes("model.layers.1.mlp.experts.1.down_proj") and not q.quantizes(
        "model.layers.1.mlp.experts.3.gate_proj"
    )
    named = _with(KIMI_INT4, f"{G}.targets", ["language_model.model.layers.1.mlp.experts.0.down_proj"])
    assert QuantConfig.from_hf(named).quantizes("model.layers.1.mlp.experts.0.down_proj", "language_model.")


def test_published_configs_by_scheme():
    assert published_config("none") is None
    assert published_config("int4-experts") == KIMI_INT4 and published_config("fp8-block") == DEEPSEEK_FP8
    with pytest.raises(ValueError) as e:
        published_config("int8")
    assert str(e.value) == "quantization: 'int8' is not one of none, int4-experts, fp8-block"


def test_refused_through_the_text_config_too():
    raw = load_preset("kimi-k2.5")
    raw["text_config"]["quantization_config"] = _with(KIMI_INT4, f"{W}.group_size", 64)
    with pytest.raises(ConfigError, match=r"group_size=64"):
        ModelConfig.from_hf(raw)
