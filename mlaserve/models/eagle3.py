"""EAGLE3 draft models in their published formats (configs: eagle3_config.py).

`LlamaForCausalLMEagle3` (SpecForge / SGLang layout; speculators' `Eagle3Speculator` maps onto it): fc over the
target's concatenated auxiliary hidden states (optionally normed first: `input_norm`, or `fc_norm.{i}` per state),
one `midlayer` whose q/k/v take [input_layernorm(embed) | hidden_norm(hidden)] (2H wide), MLP, final norm, lm_head
over `draft_vocab_size` mapped to target ids by `d2t` (target = i + d2t[i]).
`Eagle3DeepseekV3ForCausalLM`: the same, with an MLA midlayer (its latent KV in a cache of its own).

forward(ids, positions, hidden, batch) -> (normed hidden for logits, the hidden the next draft step reads: the
pre-norm stream, or the normed one under `norm_output`).

Under TP (`ranks`, where `shardable` allows) the midlayer is split as a target layer is: attention heads (o_proj
row-parallel and all-reduced), the MLP's intermediate dim, the lm_head's draft vocabulary (its logits gathered);
fc, the norms and d2t whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.base import ForwardBatch
from ..distributed import tp
from ..distributed.tp import RankInfo
from ..kernel_config import KernelConfig
from ..layers.embedding import ParallelLMHead, whole_table
from ..layers.linear import Linear, linear, linear_many, stack_rows
from ..layers.norm import RMSNorm
from ..layers.rotary_llama import apply_rope_neox, llama_cos_sin, llama_rope, rope_neox_
from .deepseek_v3 import DeepseekV3Attention, DeepseekV3MLP
from .eagle3_config import LLAMA_ARCHS, MLA_ARCHS, DraftConfig
from .weights import CheckpointError, checkpoint_files

__all__ = ["LLAMA_ARCHS", "MLA_ARCHS", "DraftConfig", "Eagle3Draft", "load_draft", "rope_neox", "shardable"]


def shardable(cfg: DraftConfig, world: int) -> bool:
    """Whether the draft splits over `world` ranks: its attention heads (GQA: the KV heads too) and the MLP's
    intermediate dim divide by it. Otherwise it runs whole on rank 0 (spec/eagle3.py)."""
    if cfg.mla is not None:
        heads = (cfg.mla.num_attention_heads,)
    else:
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
    return all(n % world == 0 for n in (*heads, cfg.intermediate_size))


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama RoPE (rotate-half layout, no scaling). x [T, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    f = positions.float()[:, None] * inv  # [T, d/2]
    return apply_rope_neox(x, f.cos(), f.sin())


class LlamaEagle3Attention(nn.Module):
    """GQA attention over the draft's paged K/V cache; q/k/v read the 2H-wide input, by one GEMM (their weights
    stacked by stack_rows), and q and k are rotated in place, in one launch on the GPU."""

    kernels = KernelConfig()  # the model's, once built (kernel_config.use_kernels)

    def __init__(self, cfg: DraftConfig, dtype, ranks: RankInfo = RankInfo()):
        super().__init__()
        self.cfg = cfg
        nh, nkv, hd, W = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, ranks.world_size
        self.num_heads, self.num_kv_heads = nh // W, nkv // W  # this rank's
        col = dict(shard="col", rank=ranks.rank, size=W, dtype=dtype)
        self.q_proj = Linear(2 * cfg.hidden_size, nh * hd, **col)
        self.k_proj = Linear(2 * cfg.hidden_size, nkv * hd, **col)
        self.v_proj = Linear(2 * cfg.hidden_size, nkv * hd, **col)
        self.o_proj = Linear(nh * hd, cfg.hidden_size, shard="row", rank=ranks.rank, size=W, dtype=dtype)
        self.reduce = W > 1
        stack_rows(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, batch: ForwardBatch):
        """x [T, 2H]; cos/sin [T, d/2] fp32 (the scaled RoPE's, attention_factor included)."""
        c, T = self.cfg, x.shape[0]
        q, k, v = (
            t.view(T, n, c.head_dim)  # column views of one [T, (heads + 2 kv heads) hd] output when stacked
            for t, n in zip(
                linear_many(x, self.q_proj, self.k_proj, self.v_proj),
                (self.num_heads, self.num_kv_heads, self.num_kv_heads),
            )
        )
        qk = _side_by_side(q, k)
        for t in (q, k) if qk is None else (qk,):
            rope_neox_(t, cos, sin, self.kernels.pdl)
        out = batch.attn.forward(q, k, v, c.head_dim**-0.5, batch)  # [T, heads of this rank, hd]
        out = self.o_proj(out.reshape(T, -1))
        return tp.all_reduce(out) if self.reduce else out


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, Hq, d] and k [T, Hk, d] as one [T, Hq + Hk, d] view where k's heads follow q's in each row of one
    buffer (linear_many's stacked output), so one RoPE launch rotates both; else None."""
    T, Hq, d = q.shape
    same = q.stride() == (q.stride(0), d, 1) and k.stride() == (q.stride(0), d, 1) and q.dtype == k.dtype
    if not same or k.data_ptr() != q.data_ptr() + Hq * d * q.element_size():
        return None
    return q.as_strided((T, Hq + k.shape[1], d), (q.stride(0), d, 1))


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, dtype, ranks: RankInfo = RankInfo()):
        super().__init__()
        H = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        if cfg.mla is not None:
            self.self_attn = DeepseekV3Attention(cfg.mla, 0, ranks, dtype, in_features=2 * H)
        else:
            self.self_attn = LlamaEagle3Attention(cfg, dtype, ranks)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = DeepseekV3MLP(H, cfg.intermediate_size, ranks, dtype)

    def forward(self, input_ids, embed, hidden, batch, rope):
        """input_ids [T], embed: the embedding they are looked up in, hidden [T, H]; rope: (cos, sin) of the step's
        positions. The two norms write the halves of the attention's input [T, 2H] (no concatenation), and the
        input norm gathers its rows from a whole table itself (no embedding launch)."""
        H = hidden.shape[-1]
        table = whole_table(embed)
        x = torch.empty(input_ids.shape[0], 2 * H, dtype=hidden.dtype, device=hidden.device)
        if table is not None:
            self.input_layernorm(table, rows=input_ids, out=x[:, :H])
        else:
            self.input_layernorm(embed(input_ids), out=x[:, :H])
        normed = self.hidden_norm(hidden, out=x[:, H:])
        residual = normed if self.norm_before_residual else hidden
        a = self.self_attn(x, *rope, batch)
        x, h = self.post_attention_layernorm(a, residual)  # h = residual + a, fused into the norm
        return self.mlp(x), h  # the output and the stream it adds to


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, dtype=torch.float32, ranks: RankInfo = RankInfo()):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = None  # set to the draft's own, or shared with the target at load
        Ht, n = cfg.target_hidden_size, cfg.num_aux_hidden_states
        self.input_norm = RMSNorm(n * Ht, cfg.rms_norm_eps, dtype=dtype) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(Ht, cfg.rms_norm_eps, dtype=dtype) for _ in range(n)) if cfg.fc_norm else None
        )
        self.fc = Linear(cfg.fc_in_features, H, dtype=dtype)
        self.midlayer = Eagle3MidLayer(cfg, dtype, ranks)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        if ranks.world_size > 1:  # this rank's slice of the draft vocabulary; the logits gathered whole
            self.lm_head = ParallelLMHead(cfg.draft_vocab_size, H, rank=ranks.rank, size=ranks.world_size, dtype=dtype)
        else:
            self.lm_head = Linear(H, cfg.draft_vocab_size, dtype=dtype)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.rotary = None
        if cfg.mla is not None:
            from ..layers.rotary import RotaryEmbedding

            self.rotary = RotaryEmbedding(cfg.mla.rope, cfg.mla.qk_rope_head_dim)
        else:
            inv_freq, self.rope_scale = llama_rope(
                dict(cfg.rope_scaling), cfg.rope_theta, cfg.head_dim, cfg.max_position_embeddings
            )
            self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def hidden_width(self) -> int:  # the target aux hidden it reads, [T, n * Ht]
        return self.cfg.fc_in_features

    @property
    def hidden_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, d/2] fp32 of the midlayer's RoPE."""
        if self.rotary is not None:
            return self.rotary(positions)
        return llama_cos_sin(positions, self.inv_freq, self.rope_scale, self.midlayer.self_attn.kernels.pdl)

    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [T, n*Ht] -> fc's output [T, H], through the config's norms."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def forward(self, input_ids, positions, hidden, batch: ForwardBatch, rows: torch.Tensor | None = None):
        """hidden: the target's aux states [T, n*Ht] or the draft's own previous output [T, H]. -> (the final
        norm's output, the stream the next step reads), [T, H] each, or of the rows `rows` [R] alone."""
        dtype = self.embed_tokens.weight.dtype
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.combine_aux(hidden.to(dtype))
        out, residual = self.midlayer(input_ids, self.embed_tokens, hidden.to(dtype), batch, self.rope(positions))
        normed, h = self.norm(out, residual, rows=rows)  # h = residual + out
        return normed, normed if self.cfg.norm_output else h

    def draft_token_ids(self, normed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy draft tokens in target ids. normed [n, H] -> [n] (into out, any stride, where given). On the GPU
        the arg-max and the d2t map are one kernel pair (kernels/argmax.py); the logits of a one- or two-row step
        come from the Triton GEMV (layers/linear.py)."""
        if isinstance(self.lm_head, ParallelLMHead):
            logits = self.lm_head(normed)
        else:
            logits = linear(normed, self.lm_head.weight, self.lm_head.kernels)
        if logits.is_cuda:
            from ..kernels.argmax import argmax_rows

            return argmax_rows(logits, out=out, pdl=self.lm_head.kernels.pdl, offsets=self.d2t)
        i = logits.argmax(-1)
        tok = i + self.d2t[i]
        return tok if out is None else out.copy_(tok)


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


def load_draft(path: str, dtype, device, target_embed: nn.Module, ranks: RankInfo = RankInfo()) -> Eagle3Draft:
    """Load a draft checkpoint (this rank's shard of it); embed_tokens comes from the draft if it has one (whole on
    every rank), else from the target."""
    from safetensors import safe_open

    cfg = DraftConfig.from_pretrained(path)
    with torch.device(device):
        model = Eagle3Draft(cfg, dtype, ranks)
    params = dict(model.named_parameters())
    loaded, own_embed, t2d = set(), None, None
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as h:
            for key in h.keys():
                name = key[len("model.") :] if key.startswith("model.") else key
                if name.startswith("layers.0."):  # speculators' and some SpecForge drafts' name for the midlayer
                    name = "midlayer." + name[len("layers.0.") :]
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
                    params[name].weight_loader(params[name], t)  # this rank's shard
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
