"""DeepSeek-V3's multi-token prediction (MTP) layer as a one-layer draft: what vLLM serves as `deepseek_mtp` and
SGLang as `NEXTN`.

The layer ships inside the target's own checkpoint as `model.layers.{L}` (L = num_hidden_layers; config.json's
`num_nextn_predict_layers` says it is there): a whole decoder layer (MLA + MoE, quantized as the target's layers
are) plus `enorm`, `hnorm`, `eh_proj` [D, 2D] and `shared_head.norm`. Its `embed_tokens` and `shared_head.head`
are copies of the target's embedding and lm_head (DeepSeek-V3 shares them by design), so the target's are used and
the copies are not read. Under TP the layer is sharded as the target's layers are (attention heads, MoE slices or
experts; the norms and eh_proj whole on every rank), and every rank runs the draft with the target's vocabulary
slices of the embedding and lm_head, as vLLM and SGLang do.

Draft position p holds the pair (the target's final hidden at p, the token at p+1), as EAGLE3's drafts do:
    x = eh_proj([enorm(embed(token)) | hnorm(hidden)])      [T, 2D] -> [T, D]
    h = decoder_layer(x)                                     the stream leaving the layer
    normed = shared_head.norm(h); logits = head(normed)      predicts the token at p+2
`hidden` is the target's final *normed* hidden (what its lm_head reads), as both vLLM and SGLang feed it. A chain
of more draft steps than MTP layers reuses the one layer, each step reading the previous step's normed output (as
SGLang does; vLLM reads the pre-norm stream). The embedding at position 0 is not masked (SGLang; vLLM zeroes it).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.base import ForwardBatch
from ..config import ModelConfig
from ..distributed.tp import RankInfo
from ..layers.embedding import ParallelLMHead, whole_table
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .deepseek_v3 import DeepseekV3DecoderLayer

# The MTP layer's tensors that copy the target's: not read (the target's are used).
SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class DeepseekMTPLayer(DeepseekV3DecoderLayer):
    """The decoder layer under its checkpoint names, plus the MTP's input projection and output norm."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ranks: RankInfo, dtype, moe_impl: str):
        super().__init__(cfg, layer_id, ranks, dtype, moe_impl)
        self.self_attn.layer_id = 0  # its latent KV is the only layer of the draft's own cache
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear(2 * D, D, dtype=dtype)  # bf16 in the published FP8 checkpoints too
        self.shared_head = SharedHead(cfg, dtype)


class _Layers(nn.Module):
    def __init__(self, cfg: ModelConfig, ranks: RankInfo, dtype, moe_impl: str):
        super().__init__()
        L = cfg.num_hidden_layers
        self.layers = nn.ModuleDict({str(L): DeepseekMTPLayer(cfg, L, ranks, dtype, moe_impl)})


class DeepseekMTP(nn.Module):
    """The draft interface EAGLE3's drafts have (spec/eagle3.py, spec/draft_graph.py):
    forward(ids, positions, hidden, batch) -> (normed [T, D], the hidden the next draft step reads [T, D]);
    draft_token_ids(normed [n, D]) -> greedy tokens [n]. Parameter names are the checkpoint's (model.layers.{L}.*);
    `embed_tokens` and `lm_head` (the target's modules: this rank's vocabulary slices under TP) are set at load."""

    def __init__(self, cfg: ModelConfig, dtype=torch.float32, moe_impl: str = "torch", ranks: RankInfo = RankInfo()):
        super().__init__()
        self.config = cfg
        self.model = _Layers(cfg, ranks, dtype, moe_impl)
        self.layer: DeepseekMTPLayer = self.model.layers[str(cfg.num_hidden_layers)]
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)
        self.embed_tokens: nn.Module | None = None
        self.lm_head: ParallelLMHead | None = None  # [vocab / TP, D]; its logits gathered whole on every rank
        self.hidden_width = cfg.hidden_size  # the width of the target hidden it reads

    @property
    def hidden_dtype(self) -> torch.dtype:
        return self.layer.eh_proj.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        rows: torch.Tensor | None = None,
    ):
        """rows [R]: return those rows only."""
        m = self.layer
        D = hidden.shape[-1]
        table = whole_table(self.embed_tokens)
        dtype = self.embed_tokens.weight.dtype
        eh = torch.empty(input_ids.shape[0], 2 * D, dtype=dtype, device=hidden.device)  # both norms write a half
        if table is not None:  # the norm gathers the embedding rows itself
            m.enorm(table, rows=input_ids, out=eh[:, :D])
        else:
            m.enorm(self.embed_tokens(input_ids), out=eh[:, :D])
        m.hnorm(hidden.to(dtype), out=eh[:, D:])
        x = m.eh_proj(eh)  # [T, D]: the stream entering the layer
        cos, sin = self.rotary(positions)
        normed, _ = m(m.input_layernorm(x), x, cos, sin, batch, m.shared_head.norm)
        if rows is not None:
            normed = normed[rows]
        return normed, normed

    def draft_token_ids(self, normed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy tokens [n] (into out, any stride, where given) by the target's head path (its GEMV at 1-2 rows on
        a GPU) and the two-launch arg-max."""
        logits = self.lm_head(normed)
        if logits.is_cuda:
            from ..kernels.argmax import argmax_rows

            return argmax_rows(logits, out=out, pdl=self.lm_head.kernels.pdl)
        tok = logits.argmax(-1)
        return tok if out is None else out.copy_(tok)
