"""A checkpoint's `quantization_config`, parsed once into a frozen QuantConfig (or refused in one line).

Two schemes are computed natively, each in its published form:
- "fp8": DeepSeek-V3/R1 and Kimi-K2's FP8 e4m3 weights with fp32 `weight_scale_inv` over 128x128 blocks, dynamic
  activations. Every linear layer is quantized except the lm_head (the router, norms and embedding are not linears).
- "int4": compressed-tensors `pack-quantized`, symmetric INT4 weights, group 32, no zero point (Kimi-K2-Thinking,
  Kimi-K2.5): the linears its `targets` name and its `ignore` list leaves out (for Kimi: the routed experts only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .config import ConfigError

FP8_BLOCK = 128
INT4_GROUP = 32
SCHEMES = ("none", "int4-experts", "fp8-block")  # make-random's --quantization choices

# The linear layers of the HF DeepSeek-V3 model, by the last part of their module name (the router `mlp.gate` is
# not one: HF keeps it as a plain weight, and no published checkpoint quantizes it).
LINEARS = frozenset(
    ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj")
    + ("down_proj", "lm_head")
)

# What the published checkpoints carry (config.json), for make-random.
DEEPSEEK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
KIMI_INT4 = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# The fields each form may carry; anything else is refused. _CT_INFO and _WEIGHT_INFO only describe how the
# checkpoint was made (not the stored numbers): accepted whatever their value.
_FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "ignored_layers"}
_FP8_KEYS |= {"modules_to_not_convert"}
_CT_KEYS = {"quant_method", "config_groups", "format", "ignore", "kv_cache_scheme", "quantization_status"}
_CT_INFO = {"global_compression_ratio", "version", "provider"}
_CT_NULL = {"sparsity_config", "transform_config", "moe_sparsity_config"}  # accepted when empty
_WEIGHT_INFO = {"observer", "observer_kwargs"}


@dataclass(frozen=True)
class QuantConfig:
    """method "fp8" (128x128 blocks) or "int4" (pack-quantized, group 32); `ignore` / `targets` as published."""

    method: str
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)
    hf: dict = field(default_factory=dict, compare=False, repr=False)  # the config.json dict, as read

    @property
    def scheme(self) -> str:
        return {"fp8": "fp8-block", "int4": "int4-experts"}[self.method]

    def describe(self) -> str:
        return {"fp8": "FP8 e4m3, 128x128 block scales", "int4": "compressed-tensors INT4, group 32"}[self.method]

    def quantizes(self, name: str, prefix: str = "") -> bool:
        """Whether the linear layer `name` (HF module name, e.g. model.layers.3.mlp.experts.0.up_proj, without the
        checkpoint's `prefix`) is stored quantized. An ignore entry may be written with or without the prefix."""
        if name.rsplit(".", 1)[-1] not in LINEARS:
            return False
        names = (name, prefix + name) if prefix else (name,)
        if any(_matches(n, pat) for n in names for pat in self.ignore):
            return False
        if self.method == "fp8":
            return name != "lm_head"  # DeepSeek's lm_head stays bf16 (vLLM and SGLang never quantize it)
        return any(t == "Linear" or _matches(n, t) for n in names for t in self.targets)

    @classmethod
    def from_hf(cls, qc, source: str = "config.json") -> QuantConfig:
        if not isinstance(qc, dict):
            raise ConfigError(f"{source}: quantization_config must be an object, got {type(qc).__name__}")
        method = qc.get("quant_method")
        if method == "fp8":
            return cls._fp8(qc, source)
        if method == "compressed-tensors":
            return cls._int4(qc, source)
        raise ConfigError(
            f"{source}: quantization_config.quant_method={method!r} is not supported; mlaserve computes 'fp8' "
            "(e4m3, 128x128 block scales) and 'compressed-tensors' (pack-quantized symmetric int4, group 32)"
        )

    @classmethod
    def _fp8(cls, qc: dict, source: str) -> QuantConfig:
        def refuse(key: str, why: str):
            raise ConfigError(f"{source}: quantization_config.{key}={qc.get(key)!r} is not supported; {why}")

        for key in sorted(set(qc) - _FP8_KEYS):
            refuse(key, "unknown field of an fp8 quantization_config")
        if qc.get("fmt", "e4m3") != "e4m3":
            refuse("fmt", "mlaserve computes float8 e4m3 weights")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            refuse("activation_scheme", "mlaserve quantizes activations dynamically (static input scales are unused)")
        if qc.get("weight_block_size") != [FP8_BLOCK, FP8_BLOCK]:
            refuse("weight_block_size", "mlaserve computes FP8 with 128x128 weight blocks (per-tensor/channel: no)")
        ignore = tuple(qc.get("ignored_layers") or ()) + tuple(qc.get("modules_to_not_convert") or ())
        return cls(method="fp8", ignore=ignore, hf=qc)

    @classmethod
    def _int4(cls, qc: dict, source: str) -> QuantConfig:
        def refuse(key: str, value, why: str):
            raise ConfigError(f"{source}: quantization_config.{key}={value!r} is not supported; {why}")

        for key in sorted(set(qc) - _CT_KEYS - _CT_INFO - _CT_NULL):
            refuse(key, qc[key], "unknown field of a compressed-tensors quantization_config")
        for key in sorted(_CT_NULL & set(qc)):
            if qc[key]:
                refuse(key, qc[key], "mlaserve computes plain pack-quantized weights")
        if qc.get("format") != "pack-quantized":
            refuse("format", qc.get("format"), "mlaserve computes compressed-tensors 'pack-quantized' int4")
        if qc.get("quantization_status", "compressed") != "compressed":
            refuse("quantization_status", qc.get("quantization_status"), "the weights must be stored compressed")
        if qc.get("kv_cache_scheme"):
            refuse("kv_cache_scheme", qc["kv_cache_scheme"], "the KV cache is kept in the model dtype")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            refuse("config_groups", groups, "expected one or more groups of int4 weights")
        targets = []
        for name, g in groups.items():
            key = f"config_groups.{name}"
            if not isinstance(g, dict):
                refuse(key, g, "expected an object")
            for act in ("input_activations", "output_activations"):
                if g.get(act):
                    refuse(f"{key}.{act}", g[act], "mlaserve computes weight-only int4 (activations in bf16)")
            if g.get("format", "pack-quantized") != "pack-quantized":
                refuse(f"{key}.format", g["format"], "mlaserve computes 'pack-quantized' int4")
            _check_int4_weights(g.get("weights"), f"{key}.weights", refuse)
            t = g.get("targets")
            if not isinstance(t, list) or not t:
                refuse(f"{key}.targets", t, "expected a list of module names, 're:' patterns or 'Linear'")
            targets += t
        ignore = qc.get("ignore") or []
        if not isinstance(ignore, list):
            refuse("ignore", ignore, "expected a list of module names or 're:' patterns")
        return cls(method="int4", ignore=tuple(ignore), targets=tuple(targets), hf=qc)


def _check_int4_weights(w, key: str, refuse) -> None:
    if not isinstance(w, dict):
        refuse(key, w, "expected the int4 weights' arguments")
    want = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": INT4_GROUP}
    default = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None}  # compressed-tensors' own
    why = {
        "num_bits": "mlaserve computes 4-bit weights",
        "type": "mlaserve computes integer int4 weights (MXFP4/NVFP4: no)",
        "symmetric": "asymmetric (zero-point) int4 is not computed",
        "group_size": f"mlaserve computes int4 with groups of {INT4_GROUP} inputs",
    }
    for k, v in want.items():
        if w.get(k, default[k]) != v:
            refuse(f"{key}.{k}", w.get(k, default[k]), why[k])
    allowed = {
        "strategy": ("group", None),
        "actorder": (None, False),
        "dynamic": (False,),
        "block_structure": (None,),
        "zp_dtype": (None,),
        "scale_dtype": (None, "torch.bfloat16", "bfloat16"),
    }
    for k, ok in allowed.items():
        if w.get(k) not in ok:
            refuse(f"{key}.{k}", w.get(k), f"mlaserve computes int4 with {k} in {list(ok)}")
    for k in sorted(set(w) - set(want) - set(allowed) - _WEIGHT_INFO):
        refuse(f"{key}.{k}", w[k], "unknown field of int4 weight arguments")


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors' rule: 're:PATTERN' is re.match (anchored at the start), anything else the exact name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def published_config(scheme: str) -> dict | None:
    """The quantization_config a published checkpoint of `scheme` carries (None for "none")."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization: {scheme!r} is not one of {', '.join(SCHEMES)}")
    return {"none": None, "int4-experts": KIMI_INT4, "fp8-block": DEEPSEEK_FP8}[scheme]
