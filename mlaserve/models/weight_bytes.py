"""Weight bytes per rank: what a loaded model holds (the load log, `LLM.weight_bytes`), and the same figures for
any config and parallel layout without loading anything (the model built on the meta device: the same classes and
shards a real load allocates). `mlaserve make-random PRESET --plan --tp 8` prints the plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.fp8_linear import Fp8ExpandedLinear, Fp8Linear
from ..layers.quant_experts import QuantExperts


@dataclass(frozen=True)
class WeightBytes:
    """One rank's weights. `quantized`: FP8 values (kv_b_proj's FP8 copy too), packed INT4 words and their scales;
    `dense`: everything in the model dtype (and the fp32 router and kv_b_proj's scales); `expanded`: the part of
    `dense` a quantized checkpoint stores in FP8 (kv_b_proj, held dequantized for the absorbed MLA projections) and
    `expanded_extra` what that costs over the FP8 form; `dequantized`: what the quantized weights would take in the
    model dtype."""

    rank: int
    quantized: int
    dense: int
    expanded: int = 0
    expanded_extra: int = 0
    dequantized: int = 0
    expanded_what: str = ""

    @property
    def total(self) -> int:
        return self.quantized + self.dense

    def line(self) -> str:
        s = (
            f"rank {self.rank} weights: {_size(self.total)} = quantized {_size(self.quantized)} (unquantized they "
            f"would take {_size(self.dequantized)}) + unquantized {_size(self.dense)}"
        )
        if self.expanded:
            s += f"; expanded from FP8: {self.expanded_what}, {_size(self.expanded)} (+{_size(self.expanded_extra)})"
        return s


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def weight_bytes(model: torch.nn.Module, rank: int = 0) -> WeightBytes:
    """The bytes `model`'s parameters hold, by kind."""
    dtype = next(p.dtype for n, p in model.named_parameters() if n.endswith("norm.weight"))  # the model dtype
    quantized = dequantized = expanded = extra = 0
    seen, what = set(), {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (Fp8Linear, QuantExperts)):
            params = list(mod.parameters())
            quantized += sum(p.numel() * p.element_size() for p in params)
            numel = mod.weight.numel() if isinstance(mod, Fp8Linear) else mod.logical_numel()
            dequantized += numel * dtype.itemsize
            seen |= {id(p) for p in params}
        elif getattr(getattr(mod, "weight", None), "expand_fp8", False):
            w = mod.weight
            held = w.numel() * w.element_size()
            # Fp8ExpandedLinear's FP8 copy (kernels.fp8_kv_b_a8), made after loading: a meta model (the plan) counts
            # the one it would hold
            w8 = getattr(mod, "w8", None)
            if w8 is not None or (w.is_meta and isinstance(mod, Fp8ExpandedLinear) and mod.holds_copy()):
                quantized += w.numel()
            expanded += held
            extra += held - w.numel() - 4 * -(-w.shape[0] // 128) * -(-w.shape[1] // 128)
            short = mod_name.rsplit(".", 1)[-1]
            what[short] = what.get(short, 0) + 1
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in seen)
    return WeightBytes(
        rank=rank,
        quantized=quantized,
        dense=dense,
        expanded=expanded,
        expanded_extra=extra,
        dequantized=dequantized,
        expanded_what=", ".join(f"{k} x{n}" for k, n in sorted(what.items())),
    )


def weight_plan(cfg, par, dtype=torch.bfloat16, moe_impl: str = "triton") -> list[WeightBytes]:
    """Every rank's WeightBytes for `cfg` under `par` (a ParallelConfig), from the model built on the meta device:
    no memory, no files."""
    from .deepseek_v3 import DeepseekV3ForCausalLM

    par.validate(cfg)
    out = []
    for rank in range(par.world_size):
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(cfg, dtype=dtype, ranks=par.rank_info(rank), moe_impl=moe_impl)
        out.append(weight_bytes(model, rank))
    return out


def mtp_bytes(cfg, ranks=None, dtype=torch.bfloat16, moe_impl: str = "triton") -> int:
    """What the MTP draft (models/deepseek_mtp.py) adds to one rank (`ranks`, a RankInfo; default one rank): its
    layer's shard (the embedding and lm_head are the target's)."""
    from ..distributed.tp import RankInfo
    from .deepseek_mtp import DeepseekMTP

    with torch.device("meta"):
        return weight_bytes(DeepseekMTP(cfg, dtype, moe_impl, ranks or RankInfo())).total


def plan_lines(
    cfg,
    par,
    dtype=torch.bfloat16,
    gpu_bytes: float = 139 * 2**30,
    utilization: float = 0.9,
    mtp: bool = False,
) -> list[str]:
    """The load log's byte plan for every rank of `par`, and whether it fits a GPU of `gpu_bytes` (default: an
    H200's 139 GiB) at `utilization`, with the KV-cache tokens the rest holds. mtp: every rank also holds its shard
    of the MTP draft and its one-layer cache (--speculative-algorithm MTP)."""
    q = cfg.quantization
    lines = [
        f"{cfg.num_hidden_layers} layers, {q.describe() if q else 'unquantized'}, {str(dtype).removeprefix('torch.')}"
        f"; attn-tp {par.attn_tp_size}, moe-tp {par.moe_tp_size}, ep {par.ep_size}"
    ]
    kv_token = cfg.num_hidden_layers * cfg.kv_cache_dim * dtype.itemsize  # the latent cache is not split by TP
    if mtp:  # the draft's per-rank bytes
        extra = [mtp_bytes(cfg, par.rank_info(r), dtype) for r in range(par.world_size)]
        lines.append(f"MTP draft: {_size(max(extra))} on a rank at most (its layer, sharded as the target's)")
    else:
        extra = [0] * par.world_size
    per = kv_token + (cfg.kv_cache_dim * dtype.itemsize if mtp else 0)  # + the draft's one-layer cache
    for wb in weight_plan(cfg, par, dtype):
        room = utilization * gpu_bytes - wb.total - extra[wb.rank]
        fits = f"fits, {_size(room)} left: {int(room // per):,} KV tokens" if room > 0 else "does NOT fit"
        lines.append(f"{wb.line()} -> {fits} of {utilization:.0%} of {gpu_bytes / 2**30:.0f} GiB")
    return lines
