"""Mixture-of-experts: DeepSeek-V3 `noaux_tc` and DeepSeek-V2 softmax routing, routed experts stacked per layer.

The functions here are the executable spec (torch, any device); `kernels/` holds the fused Triton
versions that the GPU path swaps in and that are tested against these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernel_config import KernelConfig
from .activation import silu_and_mul
from .linear import checked_copy, new_param


def route_noaux_tc(
    router_logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (weights [T, K] fp32, ids [T, K] int64).

    Select on the biased sigmoid score inside the best `topk_group` groups (a group's score is the
    sum of its top-2 biased scores; other groups get -inf), weight by the unbiased score."""
    T, E = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores + bias
    group = None
    if n_group > 1 and topk_group < n_group:
        group = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
    return _select(scores, choice, group, top_k, topk_group, norm_topk_prob, scaling)


def route_softmax(
    router_logits: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's `greedy` / `group_limited_greedy`: router_logits [T, E] fp32 -> (weights [T, K] fp32, ids [T, K]
    int64). Scores are the softmax over all experts; with groups (n_group > 1, topk_group < n_group) a group's score
    is its best expert's, and only the best `topk_group` groups compete. Weights are the scores themselves."""
    T, E = router_logits.shape
    scores = router_logits.softmax(dim=-1)
    group = scores.view(T, n_group, E // n_group).amax(-1) if n_group > 1 and topk_group < n_group else None
    return _select(scores, scores, group, top_k, topk_group, norm_topk_prob, scaling)


def _select(scores, choice, group_scores, top_k, topk_group, norm_topk_prob, scaling):
    """Both routings' common tail: only the best `topk_group` groups compete (group_scores [T, G], or None for all),
    the top_k of `choice` are picked, weighted by `scores` (renormalised if asked), times `scaling`."""
    if group_scores is not None:
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False).indices, True)
        choice = choice.masked_fill(
            ~keep.repeat_interleave(choice.shape[1] // group_scores.shape[1], dim=1), float("-inf")
        )
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    pdl: bool = True,
) -> torch.Tensor:
    """sum_k w[t,k] * down(silu(gate(x)) * up(x)) over this rank's experts [offset, offset + E_local).

    x [T, D]; w13 [E_local, 2I, D] (gate rows then up rows); w2 [E_local, D, I] -> [T, D] in x.dtype.
    Experts owned by other ranks (EP) contribute nothing here; the caller all-reduces."""
    out = torch.zeros_like(x)
    local = topk_ids - expert_offset
    owned = (local >= 0) & (local < w13.shape[0])
    for e in torch.unique(local[owned]).tolist():  # host sync: fine for the reference path
        tok, k = torch.where(local == e)
        h = F.linear(silu_and_mul(F.linear(x[tok], w13[e]), pdl), w2[e])
        out.index_add_(0, tok, (h * topk_weights[tok, k, None]).to(out.dtype))
    return out


class TopkRouter(nn.Module):
    """HF `mlp.gate`: weight [E, D] and (noaux_tc only) e_score_correction_bias [E], both kept in fp32."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = new_param(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32, loader=self._load)
        if cfg.has_correction_bias:
            self.e_score_correction_bias = new_param(cfg.n_routed_experts, dtype=torch.float32)
        else:  # DeepSeek-V2: no bias in the checkpoint; the fused routing kernel adds these zeros
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts), persistent=False)
        self._w16, self._w16_key = None, None  # bf16_weight's cache

    def _load(self, param, src) -> None:
        checked_copy(param, src[:])
        self._w16_key = None  # `.data` writes do not bump the version counter: forget the bf16 copy explicitly

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)  # [T, E] fp32

    def bf16_weight(self) -> torch.Tensor | None:
        """The weight as bf16 when that is exact (checkpoints store it in bf16; we keep it in fp32), else None.
        Then x_bf16 . w_bf16 with fp32 products and accumulation equals F.linear(x.float(), weight) up to the
        summation order (a bf16 x bf16 product is exact in fp32). Checked once per load (the weight loader resets
        it) and per weight tensor: the first call syncs, so it must come before CUDA-graph capture (the warm-up
        forwards do it)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if key != self._w16_key:
            w16 = self.weight.detach().to(torch.bfloat16)
            self._w16 = w16 if torch.equal(w16.float(), self.weight.detach()) else None
            self._w16_key = key
        return self._w16

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        if c.scoring_func == "softmax":
            return route_softmax(
                self.logits(x),
                c.num_experts_per_tok,
                c.n_group,
                c.topk_group,
                c.norm_topk_prob,
                c.routed_scaling_factor,
            )
        return route_noaux_tc(
            self.logits(x),
            self.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )


class ExpertsBase(nn.Module):
    """Routed experts stacked per layer, whatever their storage (`Experts` below: the model dtype; INT4 and FP8:
    layers/quant_experts.py). moe-TP splits each expert's intermediate dim over `tp_size` ranks; EP gives each of
    `ep_size` ranks a contiguous block of experts. Checkpoint keys are per expert and projection
    (experts.{e}.gate_proj.{suffix}, with the suffixes of `suffixes`)."""

    suffixes = ("weight",)

    kernels = KernelConfig()  # the model's, once built (kernel_config.use_kernels)

    def __init__(self, num_experts: int, hidden: int, inter: int, *, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1):
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"n_routed_experts={num_experts} is not divisible by ep_size={ep_size}")
        if inter % tp_size:
            raise ValueError(f"moe_intermediate_size={inter} is not divisible by moe_tp_size={tp_size}")
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_local = num_experts // ep_size
        self.expert_offset = ep_rank * self.num_local
        self.i_local = inter // tp_size

    def expert_shape(self, which: str, suffix: str = "weight") -> tuple[int, ...]:
        """The checkpoint shape of experts.{e}.{which}.{suffix}."""
        return (self.hidden, self.inter) if which == "down_proj" else (self.inter, self.hidden)

    def owns(self, expert: int) -> bool:
        return self.expert_offset <= expert < self.expert_offset + self.num_local

    @property
    def inter_shard(self) -> slice:
        """This rank's part of the intermediate dim."""
        return slice(self.tp_rank * self.i_local, (self.tp_rank + 1) * self.i_local)


class Experts(ExpertsBase):
    """Routed experts in the model dtype: gate_up_proj [E_local, 2I_local, D], down_proj [E_local, D, I_local].
    Also loads transformers 5's fused tensors (experts.gate_up_proj / experts.down_proj)."""

    def __init__(
        self, num_experts: int, hidden: int, inter: int, *, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1, dtype=None
    ):
        super().__init__(num_experts, hidden, inter, tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size)
        i_local = self.i_local
        self.gate_up_proj = new_param(
            self.num_local,
            2 * i_local,
            hidden,
            dtype=dtype,
            hf_shape=(num_experts, 2 * inter, hidden),
            loader=self._load_fused_w13,
        )
        self.down_proj = new_param(
            self.num_local,
            hidden,
            i_local,
            dtype=dtype,
            hf_shape=(num_experts, hidden, inter),
            loader=self._load_fused_w2,
        )

    def load_expert(self, expert: int, which: str, suffix: str, src) -> None:
        """which in gate_proj|up_proj|down_proj; src [I, D] or [D, I]. Reads only this rank's shard."""
        e = expert - self.expert_offset
        i_local = self.i_local
        if which == "down_proj":
            checked_copy(self.down_proj.data[e], src[:, self.inter_shard])
        else:
            half = slice(0, i_local) if which == "gate_proj" else slice(i_local, 2 * i_local)
            checked_copy(self.gate_up_proj.data[e, half], src[self.inter_shard])

    # transformers 5's fused tensors: [E, 2I, D] (gate rows then up rows) and [E, D, I]. Read only the
    # owned experts' shard of the intermediate dim.
    def _load_fused_w13(self, param, src) -> None:
        experts, n = slice(self.expert_offset, self.expert_offset + self.num_local), self.inter // self.tp_size
        for half, start in ((slice(0, n), 0), (slice(n, 2 * n), self.inter)):
            lo = start + self.tp_rank * n
            checked_copy(param.data[:, half], src[experts, lo : lo + n])

    def _load_fused_w2(self, param, src) -> None:
        n = self.inter // self.tp_size
        checked_copy(
            param,
            src[self.expert_offset : self.expert_offset + self.num_local, :, self.tp_rank * n : (self.tp_rank + 1) * n],
        )

    def forward(
        self,
        x,
        topk_weights,
        topk_ids,
        impl: str = "torch",
        add: torch.Tensor | None = None,
        shared: tuple | None = None,
        norm: tuple | None = None,
        plan_tokens: int = 0,
    ):
        """-> the routed experts' output [T, D], plus `add` (the shared experts') when given. Triton only: `shared`,
        the shared MLP's (gate, up, down) weights, run as S more experts whose ids the routing appended; `norm` =
        (weight, eps, residual), the add + RMSNorm after the MoE fused into its sum -> (normed, output + residual)
        (kernels.fused_moe.fused_experts). plan_tokens (the quantized experts' planned size) is not needed here: the
        bf16 forms' edges are in tokens that keep off the graph sizes, and their tiles share one K split
        (kernels/plan.py's twin walk)."""
        if impl == "triton":
            from ..kernels.fused_moe import fused_experts

            return fused_experts(
                x,
                self.gate_up_proj,
                self.down_proj,
                topk_weights,
                topk_ids,
                self.expert_offset,
                add=add,
                shared=shared,
                norm=norm,
                all_local=self.num_local == self.num_experts,
                config=self.kernels.moe_fixed_config(),  # deterministic mode: one tile config for every step
                kernels=self.kernels,
            )
        if shared is not None or norm is not None:
            raise ValueError(
                "Experts: shared-experts fusion (shared=...) and the fused norm (norm=...) need impl='triton'"
            )
        y = fused_experts_ref(
            x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.expert_offset, self.kernels.pdl
        )
        return y if add is None else y + add
