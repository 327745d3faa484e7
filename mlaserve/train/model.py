"""DeepSeek-V3 for training: whole sequences, causal attention (scaled_dot_product_attention), MLA in its naive
form, routed experts stacked per layer (train/experts.py). HF parameter names except the stacked experts, which
`hf_state_dict` splits into `experts.{e}.{gate,up,down}_proj.weight` as published checkpoints have them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .experts import expert_loads, experts_forward, route


class RMSNorm(nn.Module):
    """transformers' DeepseekV3RMSNorm: normalised in fp32, cast back, then scaled."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) (DeepSeek's layout) of x [B, H, S, P] by cos/sin [S, P/2]."""
    x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        D, H = c["hidden_size"], c["num_attention_heads"]
        self.H, self.N, self.P = H, c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        self.R, self.V = c["kv_lora_rank"], c["v_head_dim"]
        self.scale = (self.N + self.P) ** -0.5
        Q = c["q_lora_rank"]
        self.q_a_proj = nn.Linear(D, Q, bias=False)
        self.q_a_layernorm = RMSNorm(Q, c["rms_norm_eps"])
        self.q_b_proj = nn.Linear(Q, H * (self.N + self.P), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.R + self.P, bias=False)
        self.kv_a_layernorm = RMSNorm(self.R, c["rms_norm_eps"])
        self.kv_b_proj = nn.Linear(self.R, H * (self.N + self.V), bias=False)
        self.o_proj = nn.Linear(H * self.V, D, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        H, N, P, V = self.H, self.N, self.P, self.V
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, S, H, N + P).transpose(1, 2)  # [B, H, S, N+P]
        kv_a = self.kv_a_proj_with_mqa(x)  # [B, S, R+P]
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_a[..., : self.R])).view(B, S, H, N + V).transpose(1, 2)
        k_pe = rope(kv_a[..., self.R :].unsqueeze(1), cos, sin)  # [B, 1, S, P], shared by the heads
        q = torch.cat((q[..., :N], rope(q[..., N:], cos, sin)), dim=-1)
        k = torch.cat((kv[..., :N], k_pe.expand(B, H, S, P)), dim=-1)
        o = F.scaled_dot_product_attention(q, k, kv[..., N:], is_causal=True, scale=self.scale)  # [B, H, S, V]
        return self.o_proj(o.transpose(1, 2).reshape(B, S, H * V))


class MLP(nn.Module):
    def __init__(self, D: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(D, inter, bias=False)
        self.up_proj = nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """HF `mlp.gate`: weight [E, D] and the routing bias e_score_correction_bias [E] (a buffer: no gradient)."""

    def __init__(self, D: int, E: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, D))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))


class Experts(nn.Module):
    """The routed experts stacked: w13 [E, 2I, D] (gate rows, then up rows) and w2 [E, D, I]."""

    def __init__(self, D: int, E: int, inter: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, D))
        self.w2 = nn.Parameter(torch.empty(E, D, inter))


class MoE(nn.Module):
    def __init__(self, c: dict, grouped: bool):
        super().__init__()
        D, E = c["hidden_size"], c["n_routed_experts"]
        self.top_k, self.norm, self.scaling = c["num_experts_per_tok"], c["norm_topk_prob"], c["routed_scaling_factor"]
        self.grouped = grouped
        self.gate = Gate(D, E)
        self.experts = Experts(D, E, c["moe_intermediate_size"])
        self.shared_experts = MLP(D, c["moe_intermediate_size"] * c["n_shared_experts"])

    def forward(self, x):
        """x [B, S, D] -> (out [B, S, D], tokens per expert [E])."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, E], fp32 as DeepSeek-V3 routes
        weights, ids = route(logits, self.gate.e_score_correction_bias, self.top_k, self.norm, self.scaling)
        y = experts_forward(x, self.experts.w13, self.experts.w2, weights, ids, self.grouped)
        out = y + self.shared_experts(x)
        return out.view(shape), expert_loads(ids, self.gate.weight.shape[0])


class DecoderLayer(nn.Module):
    def __init__(self, c: dict, moe: bool, grouped: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MoE(c, grouped) if moe else MLP(c["hidden_size"], c["intermediate_size"])

    def forward(self, x, cos, sin):
        """-> (x, tokens per expert [E] or None for a dense layer)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.mlp(self.post_attention_layernorm(x))
        if isinstance(h, tuple):
            return x + h[0], h[1]
        return x + h, None


class Backbone(nn.Module):
    """HF `model.`: embed_tokens, layers, norm."""

    def __init__(self, c: dict, grouped: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        k = c["first_k_dense_replace"]
        self.layers = nn.ModuleList(DecoderLayer(c, i >= k, grouped) for i in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class DeepseekV3ForTraining(nn.Module):
    def __init__(self, c: dict, grouped: bool = False):
        super().__init__()
        self.config = c
        self.model = Backbone(c, grouped)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        P = c["qk_rope_head_dim"]
        inv_freq = 1.0 / c["rope_theta"] ** (torch.arange(0, P, 2, dtype=torch.float) / P)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02) everywhere, output projections scaled by 1/sqrt(2 L) (GPT-2's), norms 1, biases 0."""
        g = torch.Generator().manual_seed(seed)
        out_std = 0.02 / (2 * self.config["num_hidden_layers"]) ** 0.5
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    std = out_std if name.endswith(("o_proj.weight", "down_proj.weight", ".w2")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        for moe in self.moe_layers:
            moe.gate.e_score_correction_bias.zero_()

    def hidden(self, ids: torch.Tensor):
        """ids [B, S] -> (final hidden [B, S, D], tokens per expert [L_moe, E])."""
        S = ids.shape[1]
        freqs = torch.arange(S, device=ids.device, dtype=torch.float).unsqueeze(-1) * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()  # [S, P/2]
        x = self.model.embed_tokens(ids)
        loads = []
        for layer in self.model.layers:
            x, load = layer(x, cos, sin)
            if load is not None:
                loads.append(load)
        return self.model.norm(x), torch.stack(loads) if loads else x.new_zeros(0)

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy (fp32) of the logits of h [B, S, D] against targets [B, S] (-100: ignored)."""
        logits = self.lm_head(h).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")

    def forward(self, ids: torch.Tensor, targets: torch.Tensor):
        """-> (summed cross-entropy over all targets (fp32), tokens per expert [L_moe, E])."""
        h, loads = self.hidden(ids)
        return self.head_loss(h, targets), loads

    def compile_regions(self) -> None:
        """torch.compile each decoder layer (the MoE layers share one graph) and the loss head; parameter names
        are unchanged, so checkpoints do not depend on it."""
        for layer in self.model.layers:
            layer.compile()
        self.head_loss = torch.compile(self.head_loss)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF names and per-expert tensors (detached, on their device, in the parameters' dtype)."""
        out = {}
        for name, t in self.state_dict().items():
            if name.endswith("experts.w13"):
                base = name[: -len("w13")]
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                    out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
            elif name.endswith("experts.w2"):
                base = name[: -len("w2")]
                for e in range(t.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = t[e]
            else:
                out[name] = t
        return {k: v.detach() for k, v in out.items()}
