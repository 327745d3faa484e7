"""Which class holds each linear layer and routed-expert block: the checkpoint's quantization config decides, by
the module's HF name (its `ignore` list, DeepSeek's unquantized set). Names are those of the text model, without
the wrapper's `language_model.` prefix (an ignore entry may carry it)."""

from __future__ import annotations

from functools import lru_cache

from ..config import ConfigError, ModelConfig
from ..distributed.tp import RankInfo
from ..layers.fp8_linear import Fp8ExpandedLinear, Fp8Linear
from ..layers.linear import Linear
from ..layers.moe import Experts, ExpertsBase
from ..layers.quant_experts import Fp8Experts, Int4Experts

PROJS = ("gate_proj", "up_proj", "down_proj")
# FP8 kv_b_proj is held dequantized in the model dtype: the absorbed MLA projections (w_kc, w_vc: docs/design.md section
# 1) are per-head views of it, run by torch.bmm and the head GEMV, as vLLM and SGLang do.
EXPANDED = ("kv_b_proj",)


def linear_factory(cfg: ModelConfig | None, prefix: str, impl: str = "torch"):
    """-> make(name, in_features, out_features, **Linear kwargs): the module for linear `prefix + name`."""
    q = cfg.quantization if cfg is not None else None

    def make(name: str, in_f: int, out_f: int, **kw):
        full = prefix + name
        if q is None or not q.quantizes(full, cfg.weight_prefix):
            return Linear(in_f, out_f, **kw)
        if q.method == "int4":
            raise ConfigError(
                f"quantization_config: the linear {cfg.weight_prefix + full!r} is INT4 by its targets and ignore list; "
                "mlaserve computes INT4 for routed experts only (published Kimi checkpoints ignore it)"
            )
        if name in EXPANDED:
            if q.method == "fp8" and Fp8ExpandedLinear.serves(out_f, kw.get("shard"), kw.get("size", 1)):
                return Fp8ExpandedLinear(in_f, out_f, impl=impl, name=full, **kw)  # + the scales, for W8A8 prefill
            lin = Linear(in_f, out_f, **kw)
            lin.weight.expand_fp8 = True  # the loader may dequantize the checkpoint's FP8 into it (logged)
            return lin
        return Fp8Linear(in_f, out_f, impl=impl, name=full, **kw)

    return make


def check_unquantized(cfg: ModelConfig, name: str) -> None:
    """Refuse a quantization config that quantizes a layer mlaserve keeps in the model dtype (the lm_head)."""
    q = cfg.quantization
    if q is not None and q.quantizes(name, cfg.weight_prefix):
        raise ConfigError(
            f"quantization_config: {cfg.weight_prefix + name!r} would be {q.describe()}; mlaserve keeps it in the "
            "model dtype (add it to the ignore list if the checkpoint stores it unquantized)"
        )


def make_experts(cfg: ModelConfig, layer_id: int, ranks: RankInfo, dtype) -> ExpertsBase:
    """The routed experts of MoE layer `layer_id`: Experts (model dtype), Int4Experts or Fp8Experts."""
    shards = dict(tp_rank=ranks.moe_tp_rank, tp_size=ranks.moe_tp_size, ep_rank=ranks.ep_rank, ep_size=ranks.ep_size)
    args = (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    q = cfg.quantization
    name = f"model.layers.{layer_id}.mlp.experts"
    kinds = _expert_kinds(q, cfg.weight_prefix, name, cfg.n_routed_experts) if q is not None else set()
    if kinds == {True, False}:
        raise ConfigError(
            f"quantization_config: its ignore list quantizes some of {cfg.weight_prefix + name}'s projections but "
            "not others; mlaserve stores a layer's routed experts all quantized or all unquantized"
        )
    if kinds != {True}:
        return Experts(*args, dtype=dtype, **shards)
    cls = Int4Experts if q.method == "int4" else Fp8Experts
    return cls(*args, name=cfg.weight_prefix + name, **shards)


@lru_cache(maxsize=1024)
def _expert_kinds(q, prefix: str, name: str, n: int) -> frozenset:
    """{whether each projection of each expert of `name` is quantized} (the same on every rank: asked once)."""
    return frozenset(q.quantizes(f"{name}.{e}.{p}", prefix) for e in range(n) for p in PROJS)
