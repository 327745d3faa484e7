"""Published EAGLE3 draft formats, each written here as it is published: the draft's logits against a plain torch
reference of the EAGLE3 layer (transformers' Llama RoPE for the scaling), and EAGLE3 with it keeping greedy tokens
equal to plain decoding. Formats: SpecForge / SGLang `LlamaForCausalLMEagle3` with llama3 RoPE and
norm_before_residual; vLLM's `Eagle3LlamaForCausalLM` name with yarn RoPE, fc_norm and four aux states; linear RoPE
with norm_before_fc and norm_output; speculators' `Eagle3Speculator` (transformer_layer_config, layers.0.* names,
its speculative_tokens the default number of draft tokens)."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mlaserve.attention.base import ForwardBatch, SeqChunk
from mlaserve.attention.mha_ref import PagedMHARef
from mlaserve.config import EngineConfig, SpecConfig
from mlaserve.engine.engine import LLMEngine
from mlaserve.models.eagle3 import DraftConfig, Eagle3Draft, load_draft
from mlaserve.spec.eagle3 import aux_layer_ids

from .test_eagle3 import GREEDY, _prompts, run, tokens

transformers = pytest.importorskip("transformers")

LAYER = {  # the draft layer's Llama config, the tiny target's sizes
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 1,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
FORMATS = {
    "specforge_llama3": {
        **LAYER,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": 200,
        "norm_before_residual": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
    },
    "vllm_yarn_fc_norm": {
        **LAYER,
        "architectures": ["Eagle3LlamaForCausalLM"],
        "draft_vocab_size": 512,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        "fc_norm": True,
        "num_aux_hidden_states": 4,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2, 3],
    },
    "linear_norm_before_fc": {
        **LAYER,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": 300,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "norm_before_fc": True,
        "norm_output": True,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 0]},
    },
    "speculators": {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": {
            **LAYER,
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
        },
        "draft_vocab_size": 256,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "tiny", "architectures": ["DeepseekV3ForCausalLM"]},
        },
    },
}


def write_draft(d, config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """config.json and model.safetensors with random weights under the format's names; -> the tensors by name."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    cfg = DraftConfig.from_pretrained(str(d))
    g = torch.Generator().manual_seed(seed)
    t = {}
    for name, p in Eagle3Draft(cfg).named_parameters():
        shape = p.hf_shape if hasattr(p, "hf_shape") else tuple(p.shape)
        t[name] = 1 + 0.2 * torch.randn(shape, generator=g) if "norm" in name else torch.randn(shape, generator=g)
        if "norm" not in name:
            t[name] /= shape[-1] ** 0.5
    ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    t["d2t"] = ids - torch.arange(cfg.draft_vocab_size)
    if config.get("speculators_model_type"):  # speculators names the midlayer layers.0
        t = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in t.items()}
    save_file(t, os.path.join(d, "model.safetensors"))
    return t


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference(config: dict, t: dict, emb: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor):
    """The EAGLE3 layer over one sequence, written out: -> (normed [T, H], next-step hidden [T, H], logits)."""
    c = {**config.get("transformer_layer_config", {}), **config}
    w = {k.replace("layers.0.", "midlayer."): v for k, v in t.items()}
    eps, n = c["rms_norm_eps"], aux.shape[-1] // c["hidden_size"]
    nbr = c.get("norm_before_residual", bool(c.get("speculators_model_type")))
    h = rms(aux, w["input_norm.weight"], eps) if c.get("norm_before_fc") else aux
    if c.get("fc_norm"):
        h = torch.cat([rms(a, w[f"fc_norm.{i}.weight"], eps) for i, a in enumerate(h.chunk(n, -1))], -1)
    h = h @ w["fc.weight"].T
    a = "midlayer.self_attn."
    hn = rms(h, w["midlayer.hidden_norm.weight"], eps)
    x = torch.cat([rms(emb[ids], w["midlayer.input_layernorm.weight"], eps), hn], -1)
    T, nh, nkv, hd = len(ids), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    q = (x @ w[a + "q_proj.weight"].T).view(1, T, nh, hd).transpose(1, 2)
    k = (x @ w[a + "k_proj.weight"].T).view(1, T, nkv, hd).transpose(1, 2)
    v = (x @ w[a + "v_proj.weight"].T).view(1, T, nkv, hd).transpose(1, 2)
    lc = transformers.LlamaConfig(**{k2: v2 for k2, v2 in c.items() if k2 in LAYER or k2 == "rope_scaling"})
    rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(lc)
    cos, sin = rot(x[None], torch.arange(T)[None])
    q, k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5).transpose(1, 2).reshape(T, -1)
    h2 = (hn if nbr else h) + o @ w[a + "o_proj.weight"].T
    y = rms(h2, w["midlayer.post_attention_layernorm.weight"], eps)
    m = "midlayer.mlp."
    h3 = h2 + (F.silu(y @ w[m + "gate_proj.weight"].T) * (y @ w[m + "up_proj.weight"].T)) @ w[m + "down_proj.weight"].T
    normed = rms(h3, w["norm.weight"], eps)
    return normed, (normed if c.get("norm_output") else h3), normed @ w["lm_head.weight"].T


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_draft_equals_the_reference(tmp_path, fmt):
    config = FORMATS[fmt]
    t = write_draft(tmp_path / fmt, config)
    emb = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    draft = load_draft(str(tmp_path / fmt), torch.float32, "cpu", torch.nn.Embedding.from_pretrained(emb))
    cfg = draft.cfg
    assert cfg.source_format == ("speculators" if fmt == "speculators" else "eagle3")
    T = 37  # past the short original contexts: the scaled frequencies matter
    ids = torch.randint(0, 512, (T,), generator=torch.Generator().manual_seed(2))
    aux = torch.randn(T, cfg.fc_in_features, generator=torch.Generator().manual_seed(3))
    cache = torch.zeros(16, 4, 2, cfg.num_key_value_heads, cfg.head_dim)
    attn = PagedMHARef(cache)
    batch = ForwardBatch.build([], [SeqChunk(ids.tolist(), 0, list(range(10)), need_logits="all")], 4, "cpu", attn)
    with torch.no_grad():
        normed, nxt = draft(batch.input_ids, batch.positions, aux, batch)
        ref_normed, ref_next, ref_logits = reference(config, t, emb, ids, aux)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nxt, ref_next, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.linear(normed, draft.lm_head.weight), ref_logits, rtol=1e-5, atol=1e-5)
    want = ref_logits.argmax(-1)
    assert torch.equal(draft.draft_token_ids(normed), want + t["d2t"][want])


@pytest.fixture(scope="module")
def baseline(tiny_ckpt):
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"))
    return [tokens(e) for e in run(eng, _prompts(), GREEDY)]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_greedy_equal_with_each_format(tiny_ckpt, baseline, tmp_path, fmt):
    """The tiny target (3 layers) with the draft: aux states of every listed layer, the greedy tokens unchanged."""
    write_draft(tmp_path / fmt, FORMATS[fmt], seed=5)
    eng = LLMEngine(
        EngineConfig(model=tiny_ckpt, device="cpu"), spec=SpecConfig(draft_model=str(tmp_path / fmt), num_steps=2)
    )
    want_ids = (
        FORMATS[fmt].get("eagle_aux_hidden_state_layer_ids")
        or FORMATS[fmt]["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    assert eng.runner.model.aux_layer_ids == tuple(want_ids)
    got = run(eng, _prompts(), GREEDY)
    assert [tokens(e) for e in got] == baseline
    assert sum(e[-1].usage.spec_draft_tokens for e in got) > 0


def test_aux_layer_ids_offset_applies_to_explicit_ids_only():
    """vLLM: ids are the streams entering those layers (offset 0); SGLang: explicit id i is layer i's output (+1),
    its defaults (2, L // 2, L - 3) the streams entering them, as in vLLM."""
    from types import SimpleNamespace

    explicit = SimpleNamespace(aux_layer_ids=(1, 29, 57), num_aux_hidden_states=3)
    assert aux_layer_ids(explicit, 61, 0) == (1, 29, 57)
    assert aux_layer_ids(explicit, 61, 1) == (2, 30, 58)
    default = SimpleNamespace(aux_layer_ids=None, num_aux_hidden_states=3)
    assert aux_layer_ids(default, 61, 0) == aux_layer_ids(default, 61, 1) == (2, 30, 58)
    with pytest.raises(ValueError, match="num_aux_hidden_states=4 without eagle_aux_hidden_state_layer_ids"):
        aux_layer_ids(SimpleNamespace(aux_layer_ids=None, num_aux_hidden_states=4), 61, 0)


def test_unsupported_forms_are_refused(tmp_path):
    from mlaserve.models.weights import CheckpointError

    cases = [
        ({**FORMATS["specforge_llama3"], "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'"),
        ({**FORMATS["specforge_llama3"], "num_hidden_layers": 2}, "num_hidden_layers=2"),
        ({**FORMATS["speculators"], "speculators_model_type": "mlp"}, "speculators_model_type 'mlp'"),
        ({**FORMATS["speculators"], "transformer_layer_config": None}, "transformer_layer_config must be an object"),
    ]
    for i, (config, msg) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=msg):
            DraftConfig.from_pretrained(str(d))


def test_speculators_speculative_tokens_is_the_default_k(tiny_ckpt, baseline, tmp_path):
    """speculators' proposal_methods[0].speculative_tokens is the number of draft tokens when the user gives none
    (vLLM's num_speculative_tokens default); a flag given wins, other formats default to one, bad values are refused."""
    from mlaserve.args import engine_kwargs_from_args
    from mlaserve.cli import build_parser

    spec_dir = tmp_path / "speculators"
    write_draft(spec_dir, FORMATS["speculators"], seed=5)
    write_draft(tmp_path / "plain", FORMATS["specforge_llama3"], seed=5)

    def spec_of(draft, *flags):
        argv = ["generate", "--prompt", "x", "--speculative-algorithm", "EAGLE3"]
        argv += ["--speculative-draft-model-path", str(draft), *flags]
        return SpecConfig.from_dict(engine_kwargs_from_args(build_parser(argv).parse_args(argv))["speculative_config"])

    spec = spec_of(spec_dir)
    assert (spec.num_steps, spec.num_draft_tokens) == (3, 4)
    assert (spec_of(spec_dir, "--speculative-num-steps", "2").num_steps, spec_of(tmp_path / "plain").num_steps) == (
        2,
        1,
    )
    assert SpecConfig.from_dict({"draft_model": str(spec_dir), "num_draft_tokens": 4}).num_steps == 3
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=spec)
    assert eng.spec_k == 3
    got = run(eng, _prompts(), GREEDY)
    assert [tokens(e) for e in got] == baseline
    assert sum(e[-1].usage.spec_draft_tokens for e in got) > 0
    for bad, shown in ([{"proposal_type": "greedy"}], "None"), ([{"speculative_tokens": 0}], "0"), ([], r"\[\]"):
        cfg = {**FORMATS["speculators"], "speculators_config": {"proposal_methods": bad}}
        (spec_dir / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=r"speculators_config\.proposal_methods.* got " + shown):
            SpecConfig.from_dict({"draft_model": str(spec_dir)})
