"""ModelConfig.from_hf: both config.json forms (rope_scaling + rope_theta, transformers 5's rope_parameters),
the real presets, YaRN numbers against transformers, and clear ConfigErrors."""

import copy
import math

import pytest
import torch

from mlaserve.config import ConfigError, ModelConfig, RopeConfig
from mlaserve.layers.rotary import yarn_inv_freq
from mlaserve.models.make_random import load_preset

YARN_VARIANTS = {
    "tiny": None,  # the preset's own: factor 4, mscale = mscale_all_dim = 1
    "deepseek_v3": {
        "type": "yarn",
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 4096,
    },
    "kimi": {
        "type": "yarn",
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "no_mscale": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512},
    "mscale_differs": {
        "rope_type": "yarn",
        "factor": 16.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 256,
    },
    "no_truncate": {"type": "yarn", "factor": 4.0, "truncate": False, "original_max_position_embeddings": 1024},
    "factor_from_lengths": {"type": "yarn", "original_max_position_embeddings": 1024},
    "default": {"type": "default"},
    "null": "null",
}


def tiny_with_rope(rope):
    raw = load_preset("tiny")
    if rope == "null":
        raw["rope_scaling"] = None
    elif rope is not None:
        raw["rope_scaling"] = dict(rope)
    return raw


def to_rope_parameters(raw: dict) -> dict:
    """The same config in transformers 5's form: rope_parameters holds rope_theta and the scaling."""
    new = copy.deepcopy(raw)
    params = dict(new.pop("rope_scaling", None) or {"rope_type": "default"})
    params["rope_type"] = params.pop("type", params.get("rope_type"))
    params["rope_theta"] = new.pop("rope_theta")
    new["rope_parameters"] = params
    return new


@pytest.mark.parametrize("name", list(YARN_VARIANTS))
def test_both_config_forms_agree(name):
    raw = tiny_with_rope(YARN_VARIANTS[name])
    a, b = ModelConfig.from_hf(raw), ModelConfig.from_hf(to_rope_parameters(raw))
    assert a.rope == b.rope and a.softmax_scale == b.softmax_scale


@pytest.mark.parametrize("name", [n for n in YARN_VARIANTS if n != "factor_from_lengths"])  # transformers wants factor
def test_rope_numbers_match_transformers(name):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    raw = tiny_with_rope(YARN_VARIANTS[name])
    ours = ModelConfig.from_hf(raw)
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in raw.items() if k != "_note"})
    if hf_cfg.rope_parameters["rope_type"] == "default":
        inv_freq, factor = DeepseekV3RotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[hf_cfg.rope_parameters["rope_type"]](hf_cfg, "cpu")
    assert ours.rope.type == hf_cfg.rope_parameters["rope_type"]
    torch.testing.assert_close(yarn_inv_freq(ours.rope, ours.qk_rope_head_dim), inv_freq, rtol=1e-6, atol=0)
    assert math.isclose(ours.rope.attention_factor, factor, rel_tol=1e-12)
    hf_scale = yarn_apply_mscale(hf_cfg.rope_parameters, ours.qk_head_dim**-0.5)
    assert math.isclose(ours.softmax_scale, hf_scale, rel_tol=1e-12)


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v3", "kimi-k2.5", "moonlight-16b-a3b"])
def test_presets_parse(preset):
    raw = load_preset(preset)
    cfg = ModelConfig.from_hf(raw, preset)
    text = raw.get("text_config", raw)
    assert (
        cfg.hidden_size == text["hidden_size"] and cfg.kv_cache_dim == text["kv_lora_rank"] + text["qk_rope_head_dim"]
    )
    assert cfg.weight_prefix == ("language_model." if "text_config" in raw else "")
    assert cfg.q_lora_rank == text["q_lora_rank"]
    assert cfg.rope.type == ((text.get("rope_scaling") or {}).get("type") or "default")


def test_kimi_k25_published_numbers():
    cfg = ModelConfig.from_hf(load_preset("kimi-k2.5"))
    assert cfg.architecture == "KimiK25ForConditionalGeneration"
    assert cfg.rope == RopeConfig(
        theta=50000.0,
        type="yarn",
        factor=64.0,
        original_max_position_embeddings=4096,
        beta_fast=1.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    mscale = 0.1 * math.log(64.0) + 1
    assert math.isclose(cfg.softmax_scale, 192**-0.5 * mscale**2)
    assert cfg.rope.attention_factor == 1.0


def test_model_type_without_architectures():
    raw = load_preset("tiny")
    del raw["architectures"]
    assert ModelConfig.from_hf(raw).architecture == "DeepseekV3ForCausalLM"


def test_transformers_dtype_key():
    raw = load_preset("tiny")
    del raw["torch_dtype"]
    raw["dtype"] = "bfloat16"
    assert ModelConfig.from_hf(raw).torch_dtype == "bfloat16"


@pytest.mark.parametrize(
    "change,field",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"n_group": 3}, "n_group"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"text_config": [1, 2]}, "text_config"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_bad_config_names_the_field(change, field):
    raw = load_preset("tiny")
    raw.update(change)
    with pytest.raises(ConfigError, match=r"^some/config\.json: .*" + field):
        ModelConfig.from_hf(raw, "some/config.json")


def test_deepseek_v2_routing_and_defaults():
    """DeepseekV2ForCausalLM: softmax routing, no correction bias, norm_topk_prob false unless set; greedy drops the
    groups; a V2 routing under another scoring is refused naming both fields."""
    from mlaserve.models.make_random import load_preset

    raw = load_preset("deepseek-v2-lite")
    c = ModelConfig.from_hf(raw)
    assert (c.architecture, c.topk_method, c.scoring_func) == ("DeepseekV2ForCausalLM", "greedy", "softmax")
    assert not c.has_correction_bias and not c.norm_topk_prob and c.q_lora_rank is None
    no_norm = {k: v for k, v in raw.items() if k != "norm_topk_prob"}
    assert not ModelConfig.from_hf(no_norm).norm_topk_prob
    greedy = ModelConfig.from_hf({**raw, "n_group": 8, "topk_group": 3})
    assert (greedy.n_group, greedy.topk_group) == (1, 1)
    grouped = ModelConfig.from_hf({**raw, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3})
    assert (grouped.n_group, grouped.topk_group) == (8, 3)
    by_type = {k: v for k, v in raw.items() if k != "architectures"}
    assert ModelConfig.from_hf(by_type).architecture == "DeepseekV2ForCausalLM"
    with pytest.raises(ConfigError, match="topk_method='greedy' scoring_func='sigmoid'"):
        ModelConfig.from_hf({**raw, "scoring_func": "sigmoid"})
