"""The trained model's config.json: DeepSeek-V3 at small size (MLA with q_lora_rank, 16 routed experts of which 4
per token plus a shared expert, a dense first layer, `noaux_tc` routing), about 13 M parameters with vocab 8192.

Size: the model and its EAGLE3 draft ship in at most 40 MB of bf16, and the draft (one Llama layer with the
target's width, a draft vocabulary of vocab/2 and a copy of the embedding) is about 4.3 M parameters.
"""

from __future__ import annotations

# Every field transformers' DeepseekV3Config and mlaserve's ModelConfig read. Heads are 64 wide (48 + 16) and
# v_head_dim is 64 too, so training attention runs flash attention's equal-width path.
BASE = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 48,
    "qk_rope_head_dim": 16,
    "v_head_dim": 64,
    "intermediate_size": 768,
    "moe_intermediate_size": 64,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "initializer_range": 0.02,
    "use_cache": True,
}


def make_config(vocab_size: int, bos_token_id: int, eos_token_id: int, seq_len: int, **overrides) -> dict:
    """The config.json dict; `overrides` replace BASE fields (tests use a tiny shape)."""
    unknown = set(overrides) - set(BASE)
    if unknown:
        raise ValueError(f"model config: unknown field(s) {sorted(unknown)}")
    c = {**BASE, **overrides}
    if "num_attention_heads" in overrides and "num_key_value_heads" not in overrides:
        c["num_key_value_heads"] = c["num_attention_heads"]  # MLA: one latent serves every head
    c.update(
        vocab_size=vocab_size,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        max_position_embeddings=seq_len,
        torch_dtype="bfloat16",
    )
    if c["n_routed_experts"] % c["n_group"]:
        raise ValueError(f"n_group: must divide n_routed_experts={c['n_routed_experts']}, got {c['n_group']}")
    return c


def param_count(c: dict) -> int:
    """Parameters of the HF checkpoint (routing biases included) for a config dict."""
    D, H, V = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    N, P, R, Vh = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["kv_lora_rank"], c["v_head_dim"]
    Q = c["q_lora_rank"]
    attn = D * Q + Q + Q * H * (N + P) if Q else D * H * (N + P)
    attn += D * (R + P) + R + R * H * (N + Vh) + H * Vh * D + 2 * D  # + the layer's two norms
    dense = 3 * D * c["intermediate_size"]
    E, I = c["n_routed_experts"], c["moe_intermediate_size"]
    moe = E * D + E + E * 3 * D * I + 3 * D * I * c["n_shared_experts"]
    L, k = c["num_hidden_layers"], c["first_k_dense_replace"]
    head = V * D * (1 if c["tie_word_embeddings"] else 2) + D
    return L * attn + k * dense + (L - k) * moe + head
