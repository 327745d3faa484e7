"""The floors every speed figure is reported against (docs/benchmarking.md): decode = bytes / 4.3 TB/s, prefill =
FLOPs / 790 TFLOP/s, on one H200 as measured. Works for any ModelConfig, batch and context, and TP degree.
Bytes are those actually read: quantized weights as stored (packed INT4 words and their bf16 group scales, FP8 values
and their fp32 block scales), the rest in the model dtype."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 790e12


@dataclass(frozen=True)
class Params:
    attn: int  # per layer, all MLA projections
    dense_mlp: int  # per dense layer
    expert: int  # one routed expert
    shared: int  # the shared experts of one MoE layer
    gate: int
    embed: int
    lm_head: int


def param_counts(c: ModelConfig) -> Params:
    D, H = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = (D * c.q_lora_rank + c.q_lora_rank * H * qk + c.q_lora_rank) if c.q_lora_rank else D * H * qk
    kv = D * c.kv_cache_dim + c.kv_lora_rank + c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)
    o = H * c.v_head_dim * D
    return Params(
        attn=q + kv + o + 2 * D,
        dense_mlp=3 * D * c.intermediate_size,
        expert=3 * D * c.moe_intermediate_size,
        shared=3 * D * c.moe_intermediate_size * c.n_shared_experts,
        gate=(D + 1) * c.n_routed_experts,
        embed=c.vocab_size * D,
        lm_head=c.vocab_size * D,
    )


INT4_BYTES = 0.5 + 2 / 32  # a 4-bit value + its share of a bf16 scale per group of 32
FP8_BYTES = 1 + 4 / (128 * 128)  # an e4m3 value + its share of an fp32 scale per 128x128 block


def bytes_per_weight(c: ModelConfig, name: str, dtype_bytes: float = 2) -> float:
    """Bytes read per weight of the linear `name` (an HF module name) as the model holds it."""
    q = c.quantization
    if q is None or not q.quantizes(name, c.weight_prefix):
        return dtype_bytes
    if q.method == "int4":
        return INT4_BYTES
    return dtype_bytes if name.endswith("kv_b_proj") else FP8_BYTES  # kv_b_proj is held dequantized


def attn_bytes(c: ModelConfig, dtype_bytes: float = 2, layer: int = 0) -> float:
    """One layer's attention weights (projections and norms) in bytes."""
    D, H, R = c.hidden_size, c.num_attention_heads, c.kv_lora_rank
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank:
        linears = {"q_a_proj": D * c.q_lora_rank, "q_b_proj": c.q_lora_rank * H * qk}
    else:
        linears = {"q_proj": D * H * qk}
    linears |= {"kv_a_proj_with_mqa": D * c.kv_cache_dim, "kv_b_proj": R * H * (c.qk_nope_head_dim + c.v_head_dim)}
    linears["o_proj"] = H * c.v_head_dim * D
    norms = param_counts(c).attn - sum(linears.values())
    p = f"model.layers.{layer}.self_attn."
    return norms * dtype_bytes + sum(n * bytes_per_weight(c, p + k, dtype_bytes) for k, n in linears.items())


def routed_expert_bytes(c: ModelConfig, experts: float, moe_tp: int = 1) -> float:
    """Bytes `experts` routed experts' weights take on one moe-TP rank, as stored: the floor of a MoE kernel that
    reads them (e.g. the INT4 GEMV at Kimi-K2.5's 8 of 384 experts: 8 x 3 x 7168 x 2048 x 0.5625 B = 198 MB)."""
    m = c.first_k_dense_replace
    return experts * param_counts(c).expert / moe_tp * bytes_per_weight(c, f"model.layers.{m}.mlp.experts.0.up_proj")


def expected_experts(c: ModelConfig, tokens: int) -> float:
    """Distinct experts a layer reads for `tokens` tokens under uniform routing: E (1 - (1 - K/E)^tokens)."""
    E, K = c.n_routed_experts, c.num_experts_per_tok
    return E * (1 - (1 - K / E) ** tokens) if E else 0.0


def decode_bytes(
    c: ModelConfig,
    batch: int,
    context: int,
    q_len: int = 1,
    dtype_bytes: int = 2,
    tp: int = 1,
    kv_dtype_bytes: int | None = None,
) -> float:
    """Bytes one decode step must read on one of `tp` ranks: weights (selected experts only) + lm_head + KV.
    kv_dtype_bytes: the latent cache's bytes per value (1: --kv-cache-dtype fp8; None: dtype_bytes)."""
    p = param_counts(c)
    L, moe = c.num_hidden_layers, sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    tokens = batch * q_len
    m = c.first_k_dense_replace if moe else 0  # a MoE layer, to name its parts

    def bpw(name):
        return bytes_per_weight(c, name, dtype_bytes)

    experts = expected_experts(c, tokens) * p.expert * bpw(f"model.layers.{m}.mlp.experts.0.up_proj")
    weights = L * attn_bytes(c, dtype_bytes, m) + (L - moe) * p.dense_mlp * bpw("model.layers.0.mlp.up_proj")
    weights += moe * (p.shared * bpw(f"model.layers.{m}.mlp.shared_experts.up_proj") + p.gate * dtype_bytes + experts)
    weights += (p.lm_head + tokens * c.hidden_size) * dtype_bytes  # embedding rows read
    kv = batch * (context + q_len) * L * c.kv_cache_dim  # MLA's latent is shared by all heads: not split by TP
    return weights / tp + kv * (dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes)


def prefill_flops(c: ModelConfig, tokens: int, context: int | None = None, tp: int = 1) -> float:
    """2 x active params x T + causal attention 2 x T^2/2 x H x (N+P+V) per layer (docs/benchmarking.md); context:
    cached tokens before the T (a prefix hit's suffix, a later chunk), which each of the T also attends."""
    p = param_counts(c)
    L, moe = c.num_hidden_layers, sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    active = L * p.attn + (L - moe) * p.dense_mlp + moe * (p.shared + p.gate + c.num_experts_per_tok * p.expert)
    pairs = tokens * tokens / 2 + tokens * (context or 0)  # (query, key) pairs, causal
    attn = 2 * pairs * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * L
    return (2 * active * tokens + attn) / tp + 2 * p.lm_head / tp  # lm_head on the last token only


def decode_floor_s(c: ModelConfig, batch: int, context: int, **kw) -> float:
    return decode_bytes(c, batch, context, **kw) / HBM_BYTES_PER_S


def prefill_floor_s(c: ModelConfig, tokens: int, **kw) -> float:
    return prefill_flops(c, tokens, **kw) / BF16_FLOPS_PER_S


def chunk_floor_s(c: ModelConfig, tokens: int, context: int, dtype_bytes: int = 2) -> float:
    """A prefill chunk of `tokens` after `context` cached ones, alone in its step: its FLOPs' time or the time to read
    what it must (the weights its tokens select, the cached latent), whichever is longer. A short suffix is bound by
    the bytes (a few hundred tokens select every expert), a long chunk by the FLOPs."""
    reads = decode_bytes(c, 1, context, q_len=tokens, dtype_bytes=dtype_bytes)
    return max(prefill_floor_s(c, tokens, context=context), reads / HBM_BYTES_PER_S)


def total_params(c: ModelConfig) -> int:
    p = param_counts(c)
    L, moe = c.num_hidden_layers, sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    return (
        L * p.attn
        + (L - moe) * p.dense_mlp
        + moe * (p.shared + p.gate + c.n_routed_experts * p.expert)
        + p.embed
        + p.lm_head
        + c.hidden_size
    )
