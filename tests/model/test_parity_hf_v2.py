"""Parity with transformers' DeepseekV2ForCausalLM on tiny DeepSeek-V2-Lite-shaped models (fp32, same folder):
softmax routing (greedy and group_limited_greedy), no correction bias, no normalisation of the top-k weights,
routed_scaling_factor, q_proj without q_lora_rank, YaRN with mscale 0.707 on both cos/sin and the softmax scale."""

import pytest
import torch

from mlaserve.config import ModelConfig

from .helpers import RefRunner, generate_greedy, load_model, make_tiny
from .hf_ref import hf_greedy, hf_logits, hf_model
from .test_parity_hf import assert_logits_close, prompts

pytest.importorskip("transformers")

# DeepSeek-V2-Lite's config.json at the tiny preset's sizes.
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "q_lora_rank": None,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 2,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 128,
    },
}
CONFIGS = {
    "v2_lite": V2_LITE,
    # DeepSeek-V2 / V2.5: q_lora_rank, group_limited_greedy (8 groups keep 3 there), routed_scaling_factor 16
    "v2_group_limited": {
        **V2_LITE,
        "q_lora_rank": 48,
        "topk_method": "group_limited_greedy",
        "n_routed_experts": 16,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "routed_scaling_factor": 16.0,
    },
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp(request.param), seed=2, **CONFIGS[request.param])
    return load_model(path), hf_model(path)


def test_v2_config_and_no_correction_bias(pair):
    model, hf = pair
    cfg = model.config
    assert cfg.architecture == "DeepseekV2ForCausalLM" and cfg.scoring_func == "softmax"
    assert not cfg.has_correction_bias and not cfg.norm_topk_prob
    assert not any("e_score_correction_bias" in n for n, _ in model.named_parameters())
    # YaRN with mscale == mscale_all_dim: cos/sin unscaled, the softmax scale times mscale(40, 0.707)^2
    assert cfg.rope.attention_factor == 1.0
    assert cfg.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(cfg.rope.attention_factor, rel=1e-12)


def test_router_matches_transformers(pair):
    """The routing alone: ids as sets and their weights, on the model's own router weights."""
    model, hf = pair
    ours = next(layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate"))
    theirs = next(layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate"))
    x = 3 * torch.randn(301, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    w, ids = ours(x)
    _, ref_w, ref_ids = theirs(x)
    ids_s, o = ids.sort(-1)
    ref_s, ro = ref_ids.sort(-1)
    assert torch.equal(ids_s, ref_s)
    torch.testing.assert_close(w.gather(1, o), ref_w.gather(1, ro), rtol=1e-6, atol=1e-7)


def test_prefill_each_prompt_alone(pair):
    model, hf = pair
    for ids in prompts((1, 5, 17, 40)):
        _, (logits,) = RefRunner(model).prefill([ids])
        assert_logits_close(logits, hf_logits(hf, ids))


def test_chunked_prefill_batch(pair):
    model, hf = pair
    batch = prompts((23, 9, 40), seed=3)
    _, logits = RefRunner(model).prefill(batch, chunk=7)
    for ids, lg in zip(batch, logits):
        assert_logits_close(lg, hf_logits(hf, ids))


def test_greedy_decode_matches_generate(pair):
    """16 steps through the absorbed path, three requests in one batch, against generate()."""
    model, hf = pair
    batch = prompts((3, 12, 30), seed=4)
    tokens, logits = generate_greedy(RefRunner(model), batch, steps=16)
    for b, ids in enumerate(batch):
        ref_tokens, ref_logits = hf_greedy(hf, ids, 16)
        assert tokens[b] == ref_tokens
        assert_logits_close(logits[:, b], ref_logits)


def test_v2_lite_preset_shapes():
    """The make-random preset is DeepSeek-V2-Lite's config.json."""
    from mlaserve.models.make_random import hf_tensor_specs, load_preset

    cfg = ModelConfig.from_hf(load_preset("deepseek-v2-lite"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.q_lora_rank) == (2048, 27, 16, None)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.vocab_size) == (64, 6, 2, 102400)
    assert (cfg.topk_method, cfg.scoring_func, cfg.norm_topk_prob) == ("greedy", "softmax", False)
    specs = {name: shape for name, shape, _ in hf_tensor_specs(cfg.replace(num_hidden_layers=2))}
    assert specs["model.layers.0.self_attn.q_proj.weight"] == (16 * 192, 2048)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in specs
    assert specs["model.layers.1.mlp.gate.weight"] == (64, 2048)
    total = sum(torch.Size(s).numel() for _, s, _ in hf_tensor_specs(cfg))
    assert 15.5e9 < total < 16e9  # 15.7B parameters


def test_engine_greedy_equals_generate(tmp_path):
    """The whole engine (scheduler, paged cache, sampler) on a V2-Lite-shaped folder gives generate()'s tokens."""
    from mlaserve.config import EngineConfig
    from mlaserve.engine.engine import LLMEngine
    from mlaserve.types import SamplingParams

    path = make_tiny(tmp_path, seed=3, **V2_LITE)
    hf = hf_model(path)
    eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32"))
    batch = prompts((4, 19), seed=8)
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in batch]
    got = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    for r, ids in zip(rids, batch):
        assert got[r] == hf_greedy(hf, ids, 8)[0]
