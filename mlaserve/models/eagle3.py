"""EAGLE3 draft models in their published formats.

`LlamaForCausalLMEagle3` (SpecForge / SGLang layout): fc over the target's concatenated auxiliary hidden
states, one `midlayer` whose q/k/v take [input_layernorm(embed) | hidden_norm(hidden)] (2H wide), MLP,
final norm, lm_head over `draft_vocab_size` mapped to target ids by `d2t` (target = i + d2t[i]).
`Eagle3DeepseekV3ForCausalLM`: the same, with an MLA midlayer (its latent KV in a cache of its own).

forward(ids, positions, hidden, batch) -> (normed hidden for logits, pre-norm hidden for the next draft step).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import ForwardBatch
from ..config import ModelConfig
from ..layers.linear import Linear, checked_copy
from ..layers.norm import RMSNorm
from .deepseek_v3 import DeepseekV3Attention, DeepseekV3MLP
from .weights import CheckpointError, checkpoint_files

LLAMA_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MLA_ARCHS = ("Eagle3DeepseekV3ForCausalLM", "Eagle3DeepseekV2ForCausalLM")


@dataclass(frozen=True)
class DraftConfig:
    architecture: str
    hidden_size: int
    target_hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    aux_layer_ids: tuple[int, ...] | None
    tie_word_embeddings: bool
    mla: ModelConfig | None = None  # the MLA midlayer's shapes (MLA drafts only)

    @classmethod
    def from_pretrained(cls, path: str) -> DraftConfig:
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise CheckpointError(f"{f}: not found; the EAGLE3 draft folder needs config.json and *.safetensors")
        with open(f) as fh:
            c = json.load(fh)
        arch = (c.get("architectures") or [None])[0]
        if arch not in LLAMA_ARCHS + MLA_ARCHS:
            raise CheckpointError(
                f"{f}: unsupported draft architecture {arch!r}; mlaserve loads {', '.join(LLAMA_ARCHS + MLA_ARCHS)}"
            )
        rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
        if arch in LLAMA_ARCHS and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise CheckpointError(f"{f}: rope scaling {rope!r} is not supported for Llama-style drafts")
        H = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        eagle = c.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or c.get("eagle_aux_hidden_state_layer_ids")
        mla = None
        if arch in MLA_ARCHS:
            mla = ModelConfig.from_hf(
                {
                    **c,
                    "architectures": ["DeepseekV3ForCausalLM"],
                    "num_hidden_layers": 1,
                    "n_routed_experts": 0,
                    "first_k_dense_replace": 1,
                },
                f,
            )
        return cls(
            architecture=arch,
            hidden_size=H,
            target_hidden_size=int(c.get("target_hidden_size") or H),
            vocab_size=int(c["vocab_size"]),
            draft_vocab_size=int(c.get("draft_vocab_size") or c["vocab_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or H // heads),
            intermediate_size=int(c["intermediate_size"]),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(c.get("rope_theta", 10000.0)),
            aux_layer_ids=tuple(ids) if ids else None,
            tie_word_embeddings=bool(c.get("tie_word_embeddings")),
            mla=mla,
        )


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama RoPE (rotate-half layout). x [T, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    f = positions.float()[:, None] * inv  # [T, d/2]
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LlamaEagle3Attention(nn.Module):
    """GQA attention over the draft's paged K/V cache; q/k/v read the 2H-wide input."""

    def __init__(self, cfg: DraftConfig, dtype):
        super().__init__()
        self.cfg = cfg
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(2 * cfg.hidden_size, nh * hd, dtype=dtype)
        self.k_proj = Linear(2 * cfg.hidden_size, nkv * hd, dtype=dtype)
        self.v_proj = Linear(2 * cfg.hidden_size, nkv * hd, dtype=dtype)
        self.o_proj = Linear(nh * hd, cfg.hidden_size, dtype=dtype)

    def forward(self, x, positions, batch: ForwardBatch):
        c, T = self.cfg, x.shape[0]
        q = rope_neox(self.q_proj(x).view(T, c.num_attention_heads, c.head_dim), positions, c.rope_theta)
        k = rope_neox(self.k_proj(x).view(T, c.num_key_value_heads, c.head_dim), positions, c.rope_theta)
        v = self.v_proj(x).view(T, c.num_key_value_heads, c.head_dim)
        out = batch.attn.forward(q, k, v, c.head_dim**-0.5, batch)  # [T, nh, hd]
        return self.o_proj(out.reshape(T, -1))


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, dtype):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        if cfg.mla is not None:
            self.self_attn = DeepseekV3Attention(cfg.mla, 0, _ranks1(), dtype, in_features=2 * H)
        else:
            self.self_attn = LlamaEagle3Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = DeepseekV3MLP(H, cfg.intermediate_size, _ranks1(), dtype)

    def forward(self, embeds, hidden, positions, batch, rope=None):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        a = self.self_attn(x, positions, batch) if rope is None else self.self_attn(x, *rope, batch)
        x, h = self.post_attention_layernorm(a, residual)  # h = residual + a, fused into the norm
        return self.mlp(x), h  # the output and the stream it adds to


def _ranks1():
    from ..distributed.tp import RankInfo

    return RankInfo()


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = None  # set to the draft's own, or shared with the target at load
        self.fc = Linear(3 * cfg.target_hidden_size, H, dtype=dtype)
        self.midlayer = Eagle3MidLayer(cfg, dtype)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(H, cfg.draft_vocab_size, dtype=dtype)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.rotary = None
        if cfg.mla is not None:
            from ..layers.rotary import RotaryEmbedding

            self.rotary = RotaryEmbedding(cfg.mla.rope, cfg.mla.qk_rope_head_dim)

    def forward(self, input_ids, positions, hidden, batch: ForwardBatch):
        """hidden: the target's aux states [T, 3*Ht] or the draft's own previous output [T, H]."""
        embeds = self.embed_tokens(input_ids)
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fc(hidden.to(embeds.dtype))
        rope = self.rotary(positions) if self.rotary is not None else None
        out, residual = self.midlayer(embeds, hidden, positions, batch, rope)
        return self.norm(out, residual)  # (norm(h), h) with h = residual + out

    def draft_token_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens in target ids. normed [n, H] -> [n]."""
        i = F.linear(normed, self.lm_head.weight).argmax(-1)
        return i + self.d2t[i]


def check_vocab_map(path: str, cfg: DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor | None) -> None:
    """d2t maps every draft id into [0, vocab_size); t2d, when present, marks exactly those target ids."""
    ids = torch.arange(len(d2t)) + d2t
    bad = ((ids < 0) | (ids >= cfg.vocab_size)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise CheckpointError(
            f"{path}: d2t maps draft id {i} to target id {int(ids[i])}, outside the vocabulary [0, {cfg.vocab_size})"
        )
    if t2d is None:
        return
    if tuple(t2d.shape) != (cfg.vocab_size,):
        raise CheckpointError(f"{path}: t2d has shape {tuple(t2d.shape)}, vocab_size is {cfg.vocab_size}")
    mask = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    mask[ids] = True
    if not torch.equal(t2d.bool(), mask):
        raise CheckpointError(
            f"{path}: t2d marks {int(t2d.bool().sum())} target ids, d2t maps the draft's {len(d2t)} ids to "
            f"{int(mask.sum())} others: the two maps disagree"
        )


def load_draft(path: str, dtype, device, target_embed: nn.Module) -> Eagle3Draft:
    """Load a draft checkpoint; embed_tokens comes from the draft if it has one, else from the target."""
    from safetensors import safe_open

    cfg = DraftConfig.from_pretrained(path)
    with torch.device(device):
        model = Eagle3Draft(cfg, dtype)
    params = dict(model.named_parameters())
    loaded, own_embed, t2d = set(), None, None
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as h:
            for key in h.keys():
                name = key[len("model.") :] if key.startswith("model.") else key
                t = h.get_tensor(key)
                if name == "t2d":  # used by training only; checked against d2t
                    t2d = t
                elif name == "d2t":
                    if tuple(t.shape) != (cfg.draft_vocab_size,):
                        raise CheckpointError(
                            f"{file}: d2t has shape {tuple(t.shape)}, draft_vocab_size is {cfg.draft_vocab_size}"
                        )
                    model.d2t.copy_(t.long())
                elif name == "embed_tokens.weight":
                    if tuple(t.shape) != (cfg.vocab_size, cfg.hidden_size):
                        raise CheckpointError(
                            f"{file}: embed_tokens.weight has shape {tuple(t.shape)}, the draft's vocab_size x "
                            f"hidden_size is {(cfg.vocab_size, cfg.hidden_size)}"
                        )
                    own_embed = t
                elif name in params:
                    if tuple(t.shape) != params[name].hf_shape:
                        raise CheckpointError(
                            f"{file}: tensor {key!r} has shape {tuple(t.shape)}, expected {params[name].hf_shape}"
                        )
                    checked_copy(params[name], t)
                else:
                    raise CheckpointError(f"{file}: unexpected tensor {key!r} in the EAGLE3 draft")
                loaded.add(name)
    if "d2t" not in loaded and cfg.draft_vocab_size != cfg.vocab_size:
        raise CheckpointError(
            f"{path}: missing tensor 'd2t' (draft_vocab_size {cfg.draft_vocab_size} != vocab_size {cfg.vocab_size})"
        )
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r} in the EAGLE3 draft")
    check_vocab_map(path, cfg, model.d2t.cpu(), t2d)
    if own_embed is not None:
        model.embed_tokens = nn.Embedding(*own_embed.shape, device=device, dtype=dtype)
        model.embed_tokens.weight.requires_grad_(False).copy_(own_embed)
    else:
        model.embed_tokens = target_embed  # shared with the target
    return model.eval()
