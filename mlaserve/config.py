"""Frozen, typed configs. `ModelConfig.from_hf` normalises every config.json form once."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .quantization import QuantConfig

from .kernel_config import KernelConfig

# Architectures whose text model is DeepSeek-V3 shaped (V2: the same MLA and MoE, softmax routing), and where its
# weights sit.
SUPPORTED_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "",
    "DeepseekV2ForCausalLM": "",
    "KimiK25ForConditionalGeneration": "language_model.",
}


# MoE routings: (topk_method, scoring_func) -> what mlaserve implements. V3: noaux_tc over biased sigmoid scores;
# V2 / V2-Lite: softmax scores, top-k over all experts (greedy) or within the best groups by their max score.
ROUTINGS = {
    ("noaux_tc", "sigmoid"): "DeepSeek-V3",
    ("greedy", "softmax"): "DeepSeek-V2",
    ("group_limited_greedy", "softmax"): "DeepSeek-V2",
}

# dtype names a config.json (torch_dtype) or --dtype may give -> torch's attribute names
DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
}


def torch_dtype(name: str):
    """The torch.dtype DTYPES names; ValueError naming the choices. (torch is imported here, not at the top: the
    command line's help and the bench client import config without it.)"""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not supported; use bfloat16, float16 or float32")
    return getattr(torch, DTYPES[name])


class ConfigError(ValueError):
    """A config.json we cannot serve; the message names the file and the field."""


@dataclass(frozen=True)
class RopeConfig:
    """RoPE for the `qk_rope_head_dim` part, with optional YaRN scaling (DeepSeek/transformers form)."""

    theta: float
    type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None  # None when config.json omits it (changes attention_factor)
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @staticmethod
    def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def attention_factor(self) -> float:
        """Scale folded into cos/sin (transformers' `attention_factor`)."""
        if self.type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.factor, self.mscale) / self.yarn_mscale(self.factor, self.mscale_all_dim)
        return self.yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """Factor on the softmax scale: mscale(factor, mscale_all_dim)^2 under YaRN."""
        if self.type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return self.yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def _flag(field: str) -> str:
    """A ParallelConfig field's command-line flag: attn_tp_size -> attn-tp-size."""
    return field.replace("_", "-")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits. world = attn_tp_size = moe_tp_size * ep_size."""

    rank: int = 0
    world_size: int = 1
    moe_tp_size: int = 1
    ep_size: int = 1

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes: world = attn_tp_size = moe_tp_size * ep_size (no DP attention).

    Attention heads split over attn-TP; routed experts by intermediate dim (moe-TP) and by expert (EP); the dense
    MLP, shared experts, embedding and lm_head over the whole world. Multi-node: `nnodes` machines with
    world / nnodes ranks each, meeting at `dist_init_addr` ("host:port" or a torch init_method URL)."""

    attn_tp_size: int = 1
    moe_tp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_init_timeout_s: float = 300.0  # how long the ranks wait for each other at start (--dist-init-timeout)

    def __post_init__(self):
        for name in ("attn_tp_size", "moe_tp_size", "ep_size", "nnodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} (--{_flag(name)}) must be a positive integer, got {v!r}")
        if self.moe_tp_size * self.ep_size != self.attn_tp_size:
            raise ValueError(
                f"moe_tp_size * ep_size ({self.moe_tp_size} * {self.ep_size} = {self.moe_tp_size * self.ep_size}) "
                f"must equal attn_tp_size ({self.attn_tp_size}): every rank runs both attention and experts "
                "(--moe-tp-size x --ep-size = --attn-tp-size)"
            )
        if self.world_size % self.nnodes:
            raise ValueError(
                f"world size {self.world_size} (attn_tp_size) is not divisible by nnodes={self.nnodes} "
                "(--nnodes: every machine runs the same number of ranks)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank (--node-rank) must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(f"nnodes={self.nnodes} needs dist_init_addr (--dist-init-addr host:port of node 0)")
        if self.dist_init_addr and "://" not in self.dist_init_addr:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"dist_init_addr (--dist-init-addr) must be host:port (port 1-65535) or a URL such as "
                    f"tcp://host:port, got {self.dist_init_addr!r}"
                )
        if not self.dist_init_timeout_s > 0:
            raise ValueError(f"dist_init_timeout_s (--dist-init-timeout) must be > 0, got {self.dist_init_timeout_s}")

    @classmethod
    def from_tp(
        cls,
        tp: int | None = None,
        *,
        attn_tp_size: int | None = None,
        moe_tp_size: int | None = None,
        ep_size: int | None = None,
        **kw,
    ) -> ParallelConfig:
        """--tp N is shorthand for attn_tp = moe_tp = N, ep = 1; explicit sizes win. With only ep (or only
        moe_tp) given, the other MoE size fills the world: moe_tp = world / ep."""
        if tp is not None and attn_tp_size is not None and tp != attn_tp_size:
            raise ValueError(f"tp={tp} and attn_tp_size={attn_tp_size} disagree; give one of them")
        world = attn_tp_size or tp or 1
        if moe_tp_size is None and ep_size is None:
            moe_tp_size, ep_size = world, 1
        elif moe_tp_size is None:
            moe_tp_size = max(world // ep_size, 1)
        elif ep_size is None:
            ep_size = max(world // moe_tp_size, 1)
        return cls(attn_tp_size=world, moe_tp_size=moe_tp_size, ep_size=ep_size, **kw)

    @property
    def world_size(self) -> int:
        return self.attn_tp_size

    @property
    def local_world_size(self) -> int:
        """Ranks per node (one process each)."""
        return self.world_size // self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.local_world_size + local_rank

    def rank_info(self, rank: int) -> RankInfo:
        """The RankInfo of global rank `rank`."""
        return RankInfo(rank=rank, world_size=self.world_size, moe_tp_size=self.moe_tp_size, ep_size=self.ep_size)

    def validate(self, cfg: ModelConfig) -> None:
        """Refuse sizes that do not divide what they split, naming the flag and both numbers (vocab is padded: any
        size)."""

        def need(size: str, n: int, what: str, total: int, why: str) -> None:
            if total % n:
                flag = f"--{_flag(size)}" if size.isidentifier() else "--attn-tp-size / --tp"
                raise ValueError(
                    f"{size}={n} ({flag}) does not divide {what}={total} ({why}); choose a size that divides it"
                )

        world = "the world size (attn_tp_size)"
        need(
            "attn_tp_size",
            self.attn_tp_size,
            "num_attention_heads",
            cfg.num_attention_heads,
            "attention heads are split over the attn-TP ranks",
        )
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            need(
                world,
                self.world_size,
                "intermediate_size",
                cfg.intermediate_size,
                "the dense MLP is split over every rank",
            )
        if cfg.n_routed_experts:
            need(
                "ep_size",
                self.ep_size,
                "n_routed_experts",
                cfg.n_routed_experts,
                "routed experts are split over the EP ranks",
            )
            need(
                "moe_tp_size",
                self.moe_tp_size,
                "moe_intermediate_size",
                cfg.moe_intermediate_size,
                "each routed expert's intermediate dim is split over the moe-TP ranks",
            )
            if cfg.n_shared_experts:
                need(
                    world,
                    self.world_size,
                    "the shared experts' intermediate size",
                    cfg.moe_intermediate_size * cfg.n_shared_experts,
                    "moe_intermediate_size * n_shared_experts, split over every rank",
                )


@dataclass(frozen=True)
class ModelConfig:
    """The DeepSeek-V3 text model, as config.json describes it (any of its published forms)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    moe_layer_freq: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    topk_method: str = "noaux_tc"  # a ROUTINGS key with scoring_func
    scoring_func: str = "sigmoid"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    weight_prefix: str = ""  # "language_model." for the Kimi-K2.5 wrapper
    num_nextn_predict_layers: int = 0
    quantization: QuantConfig | None = None  # the checkpoint's quantization_config (mlaserve/quantization.py)
    # Raw text config, for writers (make-random) and for transformers parity tests.
    hf_text_config: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale

    @property
    def has_correction_bias(self) -> bool:
        """noaux_tc routers carry `e_score_correction_bias`; DeepSeek-V2's do not."""
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts > 0 and layer_id >= self.first_k_dense_replace and layer_id % self.moe_layer_freq == 0
        )

    @property
    def kv_cache_dim(self) -> int:
        """Values per token per layer in the latent cache: [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ---- loading --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch is None and cfg.get("model_type") in ("deepseek_v3", "kimi_k2"):
            arch = "DeepseekV3ForCausalLM"
        if arch is None and cfg.get("model_type") == "deepseek_v2":
            arch = "DeepseekV2ForCausalLM"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: unsupported architecture {arch!r}; mlaserve serves "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        prefix = SUPPORTED_ARCHITECTURES[arch]
        text = cfg.get("text_config") if "text_config" in cfg else cfg
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: 'text_config' must be an object")

        def get(name, default=KeyError):
            if name in text and text[name] is not None:
                return text[name]
            if default is KeyError:
                raise ConfigError(f"{source}: missing required field {name!r}")
            return default

        v2 = arch == "DeepseekV2ForCausalLM"
        topk_method = get("topk_method", "greedy" if v2 else "noaux_tc")
        scoring = get("scoring_func", "softmax" if v2 else "sigmoid")
        if int(get("n_routed_experts", 0)) > 0 and (topk_method, scoring) not in ROUTINGS:
            raise ConfigError(
                f"{source}: routing topk_method={topk_method!r} scoring_func={scoring!r} is not supported; mlaserve "
                f"implements {', '.join(f'{m} with {s} scoring ({who})' for (m, s), who in ROUTINGS.items())}"
            )
        if get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act={get('hidden_act')!r} is not supported (only 'silu')")
        if get("attention_bias", False):
            raise ConfigError(f"{source}: attention_bias=true is not supported")
        heads = int(get("num_attention_heads"))
        if int(get("num_key_value_heads", heads)) != heads:
            raise ConfigError(f"{source}: num_key_value_heads must equal num_attention_heads for MLA")
        n_group = int(get("n_group", 1))
        topk_group = int(get("topk_group", 1))
        if topk_method == "greedy":  # top-k over all experts: the groups play no part
            n_group = topk_group = 1
        n_experts = int(get("n_routed_experts", 0))
        if n_experts and n_experts % n_group:
            raise ConfigError(f"{source}: n_routed_experts={n_experts} is not divisible by n_group={n_group}")

        from .quantization import QuantConfig

        # Kimi-K2.5 keeps it in text_config (SGLang copies it up); DeepSeek-V3 and Kimi-K2 at the top level.
        qc = text.get("quantization_config") or cfg.get("quantization_config")
        eos = text.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            moe_intermediate_size=int(get("moe_intermediate_size", 0)),
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=heads,
            q_lora_rank=text.get("q_lora_rank"),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            n_routed_experts=n_experts,
            n_shared_experts=int(get("n_shared_experts", 0)),
            num_experts_per_tok=int(get("num_experts_per_tok", 0)),
            n_group=n_group,
            topk_group=topk_group,
            first_k_dense_replace=int(get("first_k_dense_replace", 0)),
            moe_layer_freq=int(get("moe_layer_freq", 1)),
            norm_topk_prob=bool(get("norm_topk_prob", not v2)),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            rope=_rope_from_hf(text, source),
            topk_method=topk_method,
            scoring_func=scoring,
            bos_token_id=text.get("bos_token_id"),
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            weight_prefix=prefix,
            num_nextn_predict_layers=int(text.get("num_nextn_predict_layers") or 0),
            quantization=QuantConfig.from_hf(qc, source) if qc else None,
            hf_text_config=dict(text),
        )

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        return cls.from_hf(read_config_json(path), os.path.join(path, "config.json"))

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)


def read_config_json(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise ConfigError(f"{f}: not found; a model folder needs config.json and *.safetensors")
    try:
        with open(f) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: not valid JSON ({e})") from None


def _rope_from_hf(text: dict, source: str) -> RopeConfig:
    """Accepts the original `rope_scaling` + `rope_theta` and transformers 5's `rope_parameters`."""
    params = dict(text.get("rope_parameters") or {})
    scaling = dict(text.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", text.get("rope_theta", 10000.0)))
    rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rtype == "default":
        return RopeConfig(theta=theta)
    if rtype != "yarn":
        raise ConfigError(f"{source}: rope type {rtype!r} is not supported (only default and yarn)")
    orig = int(merged.get("original_max_position_embeddings") or text.get("max_position_embeddings", 4096))
    factor = merged.get("factor")
    if factor is None:
        factor = text.get("max_position_embeddings", orig) / orig
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=float(factor),
        original_max_position_embeddings=orig,
        beta_fast=float(merged.get("beta_fast") or 32),
        beta_slow=float(merged.get("beta_slow") or 1),
        mscale=None if merged.get("mscale") is None else float(merged["mscale"]),
        mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
        truncate=bool(merged.get("truncate", True)),
    )


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 is e4m3, as in vLLM


def kv_cache_dtype_error(value: str) -> str:
    """The one line refusing a kv_cache_dtype outside KV_CACHE_DTYPES."""
    why = " (an e5m2 cache is not implemented: its 2 mantissa bits lose more than e4m3's)" if "e5m2" in value else ""
    return (
        f"kv_cache_dtype: {value!r} is not supported{why}; use auto (the model's dtype), fp8 or fp8_e4m3 "
        "(an e4m3 latent cache with one scale per layer)"
    )


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs a model. Defaults follow vLLM/SGLang habits."""

    model: str
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str = "auto"  # "auto": the checkpoint's torch_dtype
    page_size: int = 64
    num_pages: int | None = None  # None: sized from memory (gpu_memory_utilization / kv_cache_memory_gb)
    gpu_memory_utilization: float = 0.90
    kv_cache_memory_gb: float = 1.0  # CPU only: memory for the KV cache when num_pages is not given
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # token budget of one step (prefill chunks + decode tokens)
    chunked_prefill_size: int = 8192  # largest prefill chunk of one request in one step
    max_model_len: int | None = None  # None: max_position_embeddings
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs
    disable_overlap_schedule: bool = False  # True: read each decode step back before launching the next
    prefill_graph_max_tokens: int = 8192
    # prefill graphs over cached context (a prefix hit's suffix, a long prompt's later chunks): the largest context
    # (cached + new tokens) such a graph holds; 0: those chunks run eagerly
    prefill_graph_max_context: int = 16384
    warmup: bool = True  # GPU: run every eager step shape at start-up, so no Triton kernel compiles while serving
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" / "fp8_e4m3": e4m3 latent, one scale per layer
    moe_backend: str = "auto"  # "auto" | "torch" | "triton"
    load_format: str = "auto"  # "auto": safetensors; "dummy": random weights in place (no files read)
    seed: int = 0
    max_queue_len: int = 1024  # waiting requests beyond this are refused (server: 503)
    max_logprobs: int = 20  # the most alternatives logprobs / prompt_logprobs may ask for
    tokenizer: str | None = None  # a folder with the tokenizer files (None: the model's)
    chat_template: str | None = None  # a chat template replacing the tokenizer's (the text, not a path)
    # the kernels' switches and thresholds; by default the MLASERVE_* environment's, read once here
    kernels: KernelConfig = field(default_factory=KernelConfig.from_env)
    # deterministic inference: a request's tokens do not depend on what it is batched with (kernels pinned by
    # KernelConfig.batch_invariant; what is not yet invariant: kernel_config.NOT_YET_INVARIANT)
    deterministic: bool = False

    def __post_init__(self):
        if self.deterministic and not self.kernels.deterministic:  # the kernels every rank gets (frozen: set once)
            object.__setattr__(self, "kernels", self.kernels.batch_invariant())

    def validate(self) -> None:
        for name, lo in (
            ("page_size", 1),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("chunked_prefill_size", 1),
        ):
            if getattr(self, name) < lo:
                raise ValueError(f"{name}: must be >= {lo}, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be >= 0, got {self.max_logprobs}")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError(
                f"prefill_graph_max_tokens: must be >= 0 (0: no prefill graphs), got {self.prefill_graph_max_tokens}"
            )
        if self.prefill_graph_max_context < 0:
            raise ValueError(
                "prefill_graph_max_context: must be >= 0 (0: chunks over cached context run eagerly), got "
                f"{self.prefill_graph_max_context}"
            )
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb: must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_model_len is not None and self.max_model_len < 2:  # a prompt token and a generated one
            raise ValueError(f"max_model_len: must be >= 2 (or unset: the model's), got {self.max_model_len}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages: must be >= 2, got {self.num_pages}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend: must be auto, torch or triton, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(kv_cache_dtype_error(self.kv_cache_dtype))
        if self.moe_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"moe_backend: must be auto, torch or triton, got {self.moe_backend!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: must be auto or dummy, got {self.load_format!r}")


GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # vLLM's keys


def generation_sampling_defaults(model_dir: str | None) -> dict:
    """The sampling fields of a model folder's generation_config.json (numbers only); {} without the file."""
    path = os.path.join(model_dir, "generation_config.json") if model_dir else None
    if path is None or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(gen, dict):
        return {}
    ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    return {k: gen[k] for k in GENERATION_SAMPLING_KEYS if ok(gen.get(k))}


def draft_speculative_tokens(path: str | None) -> int | None:
    """A speculators draft's number of draft tokens (config.json's speculators_config.proposal_methods[0]
    .speculative_tokens), the default num_steps for it as in vLLM; None for a draft in another format or no draft."""
    f = os.path.join(path, "config.json") if path else None
    if f is None or not os.path.isfile(f):
        return None
    try:
        with open(f) as fh:
            c = json.load(fh)
    except (OSError, ValueError):
        return None  # the draft loader reports a config it cannot read
    spec = c.get("speculators_config") if isinstance(c, dict) else None
    if not isinstance(spec, dict):
        return None
    methods = spec.get("proposal_methods")
    where = f"{f}: speculators_config.proposal_methods"
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        raise ValueError(f"{where} must be a non-empty list of objects, got {methods!r}")
    n = methods[0].get("speculative_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{where}[0].speculative_tokens must be an integer >= 1, got {n!r}")
    return n


NGRAM_MAX = 64  # the longest n-gram NGRAM looks up (prompt_lookup_max)


@dataclass(frozen=True)
class SpecConfig:
    """Chain drafting: `num_steps` draft tokens per step, verified together (N = num_steps + 1).

    EAGLE3: the draft model in `draft_model` proposes. REPLAY (benchmark only): the target's own greedy outputs,
    recorded in `replay_path`, are proposed, each position a deliberate miss with probability `replay_miss_rate`
    (seeded by `replay_seed`); with `draft_model` the EAGLE3 draft still runs each step, so the step costs what an
    EAGLE3 step does and only the tokens are replaced.

    `simulate_acceptance` (benchmark only, EAGLE3): each greedy request's draft positions are accepted with that
    probability, whatever the target computes (the chain stops at the first rejection; drawn on the device from a
    generator seeded by `replay_seed`), and the step emits the accepted drafts and the target's token after them.
    Every kernel, the overlap and the draft run as they would at that acceptance, at any context, but the text is
    not the target's greedy text. REPLAY keeps the text and needs the target to reproduce a recording.

    MTP (DeepSeek-V3/R1's multi-token prediction layer, spec/mtp.py; vLLM's `deepseek_mtp`, SGLang's `NEXTN`): no
    draft folder; the draft is layer num_hidden_layers of the target's own checkpoint, chained like EAGLE3's.

    NGRAM (prompt lookup, spec/ngram.py): no draft model; the drafts continue the latest earlier occurrence of the
    context's longest suffix n-gram, n in [prompt_lookup_min, prompt_lookup_max] (vLLM's defaults: one given sets
    the other, neither gives 5 and 5)."""

    draft_model: str | None = None
    algorithm: str = "EAGLE3"
    num_steps: int = 1
    num_draft_tokens: int = 2
    # The draft's explicit aux layer ids: 0: capture the residual stream entering layer `id` (vLLM); 1: leaving it
    # (SGLang/SpecForge). Not applied to the default ids (2, L // 2, L - 3), which both read as entering.
    aux_layer_offset: int = 0
    replay_path: str | None = None
    replay_miss_rate: float = 0.0
    replay_seed: int = 0
    simulate_acceptance: float | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    # vLLM's speculative_config keys -> ours (vLLM: {"method": "eagle3", "model": DIR, "num_speculative_tokens": n})
    VLLM_KEYS = {"method": "algorithm", "model": "draft_model", "num_speculative_tokens": "num_steps"}

    @classmethod
    def normalize(cls, d: dict) -> dict:
        """A speculative_config dict in our keys, vLLM's translated (methods eagle3, deepseek_mtp / mtp, ngram)."""
        d = dict(d)
        for theirs, ours in cls.VLLM_KEYS.items():
            if theirs not in d:
                continue
            if ours in d:
                raise ValueError(f"speculative_config: {theirs!r} (vLLM's name) and {ours!r} both given")
            v = d.pop(theirs)
            if theirs == "method":
                m = v.lower() if isinstance(v, str) else None
                if m not in ("eagle3", "ngram", "[ngram]", "deepseek_mtp", "mtp"):
                    raise ValueError(
                        "speculative_config.method: eagle3 (an EAGLE3 draft, chain drafting), deepseek_mtp (the "
                        f"target's MTP layer) or ngram (prompt lookup) is served, got {v!r}"
                    )
                v = {"eagle3": "EAGLE3", "deepseek_mtp": "MTP", "mtp": "MTP"}.get(m, "NGRAM")
            d[ours] = v
        return d

    @classmethod
    def from_dict(cls, d: dict | SpecConfig) -> SpecConfig:
        if isinstance(d, SpecConfig):
            return d
        d = cls.normalize(d)
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(
                f"speculative_config: unknown keys {sorted(extra)} (known: {sorted(known | set(cls.VLLM_KEYS))})"
            )
        steps = d.get("num_steps")
        if steps is None:  # vLLM: a speculators draft's own speculative_tokens, else one
            steps = draft_speculative_tokens(d.get("draft_model")) or 1
        steps = int(steps)
        if str(d.get("algorithm", "")).upper() == "NEXTN":  # SGLang's name
            d["algorithm"] = "MTP"
        if str(d.get("algorithm", "")).upper() == "NGRAM":  # vLLM's defaults
            lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
            d["prompt_lookup_min"] = 5 if lo is None and hi is None else (hi if lo is None else lo)
            d["prompt_lookup_max"] = d["prompt_lookup_min"] if hi is None else hi
        cfg = cls(**{**d, "num_steps": steps, "num_draft_tokens": int(d.get("num_draft_tokens") or steps + 1)})
        cfg.validate()
        return cfg

    @property
    def is_replay(self) -> bool:
        return self.algorithm.upper() == "REPLAY"

    @property
    def is_ngram(self) -> bool:
        return self.algorithm.upper() == "NGRAM"

    @property
    def is_mtp(self) -> bool:
        return self.algorithm.upper() in ("MTP", "NEXTN")  # NEXTN: SGLang's name

    def _validate_ngram(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= NGRAM_MAX:
                raise ValueError(f"speculative_config.{name}: an integer in [1, {NGRAM_MAX}], got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min: at most prompt_lookup_max ({self.prompt_lookup_max}), got "
                f"{self.prompt_lookup_min}"
            )
        for name, what in (
            ("draft_model", "a draft model"),
            ("replay_path", "recorded outputs"),
            ("simulate_acceptance", "simulated acceptance"),
        ):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name}: NGRAM drafts from the context and takes no {what}")

    def validate(self) -> None:
        if not isinstance(self.algorithm, str) or self.algorithm.upper() not in (
            "EAGLE3",
            "MTP",
            "NEXTN",
            "NGRAM",
            "REPLAY",
        ):
            raise ValueError(
                "speculative_config.algorithm: EAGLE3, MTP (or NEXTN), NGRAM, or REPLAY (benchmark only), got "
                f"{self.algorithm!r}"
            )
        if self.is_mtp:
            for name, what in (("draft_model", "draft folder"), ("replay_path", "recorded outputs")):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"speculative_config.{name}: MTP drafts with the target checkpoint's own MTP layer and takes "
                        f"no {what}"
                    )
        if self.is_ngram:
            self._validate_ngram()
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config.prompt_lookup_min/max: only the NGRAM algorithm looks up n-grams")
        if not self.is_replay and not self.is_ngram and not self.is_mtp and not self.draft_model:
            raise ValueError("speculative_config.draft_model: the EAGLE3 draft's folder is required")
        if self.num_steps < 1:
            raise ValueError(f"speculative_config.num_steps: must be >= 1, got {self.num_steps}")
        if self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"speculative_config.num_draft_tokens: chain drafting verifies num_steps + 1 = "
                f"{self.num_steps + 1} tokens, got {self.num_draft_tokens}"
            )
        if self.aux_layer_offset not in (0, 1):
            raise ValueError(f"speculative_config.aux_layer_offset: must be 0 or 1, got {self.aux_layer_offset}")
        if self.draft_model and not os.path.isdir(self.draft_model):
            raise ValueError(f"speculative_config.draft_model: {self.draft_model!r} is not a folder")
        a = self.simulate_acceptance
        if a is not None:
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
                raise ValueError(f"speculative_config.simulate_acceptance: must be in [0, 1], got {a!r}")
            if self.is_replay:
                raise ValueError(
                    "speculative_config.simulate_acceptance: for EAGLE3 only (REPLAY sets its acceptance by its misses)"
                )
        if self.is_ngram:
            return
        if not self.is_replay:
            if self.replay_path is not None:
                raise ValueError("speculative_config.replay_path: only the REPLAY algorithm reads recorded outputs")
            return
        if not self.replay_path or not os.path.isfile(self.replay_path):
            raise ValueError(
                f"speculative_config.replay_path: REPLAY needs a file of recorded greedy outputs "
                f"(`mlaserve bench serve --save-replay FILE` writes one), got {self.replay_path!r}"
            )
        if not isinstance(self.replay_miss_rate, (int, float)) or not 0 <= self.replay_miss_rate <= 1:
            raise ValueError(f"speculative_config.replay_miss_rate: must be in [0, 1], got {self.replay_miss_rate!r}")
