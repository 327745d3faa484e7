"""EAGLE3 draft configs in their published forms, normalised once into `DraftConfig`.

- SpecForge / SGLang `LlamaForCausalLMEagle3` (vLLM: `Eagle3LlamaForCausalLM`): a Llama config plus `draft_vocab_size`,
  `target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids` (or the key at the top level), and the
  variants `norm_before_residual`, `norm_before_fc` (one RMSNorm over the concatenated aux states), `fc_norm` (one
  per aux state), `norm_output`, `num_aux_hidden_states`; `rope_scaling` default / linear / llama3 / yarn.
- speculators `Eagle3Speculator` (`speculators_model_type: eagle3`): the layer's Llama config in
  `transformer_layer_config`, the EAGLE3 fields beside it; `norm_before_residual` defaults to true, as vLLM reads it.
- MLA drafts (`Eagle3DeepseekV3ForCausalLM`): a DeepSeek-V3 attention config for the midlayer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..config import ModelConfig
from .weights import CheckpointError

LLAMA_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MLA_ARCHS = ("Eagle3DeepseekV3ForCausalLM", "Eagle3DeepseekV2ForCausalLM")
SPECULATORS_ARCH = "Eagle3Speculator"
# speculators' EAGLE3 fields that sit beside transformer_layer_config (vLLM's update_eagle3 copies them over it)
_SPECULATORS_FIELDS = (
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "num_aux_hidden_states",
)


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
    aux_layer_ids: tuple[int, ...] | None  # as the config gives them; spec.eagle3.aux_layer_ids interprets them
    tie_word_embeddings: bool
    mla: ModelConfig | None = None  # the MLA midlayer's shapes (MLA drafts only)
    num_aux_hidden_states: int = 3  # aux states concatenated into fc's input
    rope_scaling: tuple[tuple[str, object], ...] = ()  # Llama drafts: rope_scaling's items (layers.rotary_llama)
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden), not hidden
    norm_before_fc: bool = False  # input_norm over the concatenated aux states before fc
    fc_norm: bool = False  # fc_norm.{i}: one RMSNorm per aux state before fc
    norm_output: bool = False  # the next draft step reads the normed output, not the pre-norm stream
    source_format: str = "eagle3"  # "eagle3" | "speculators"

    @property
    def fc_in_features(self) -> int:
        return self.num_aux_hidden_states * self.target_hidden_size

    @classmethod
    def from_pretrained(cls, path: str) -> DraftConfig:
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise CheckpointError(f"{f}: not found; the EAGLE3 draft folder needs config.json and *.safetensors")
        with open(f) as fh:
            c = json.load(fh)
        fmt = "eagle3"
        if c.get("speculators_model_type") is not None or (c.get("architectures") or [None])[0] == SPECULATORS_ARCH:
            c, fmt = _from_speculators(c, f), "speculators"
        arch = (c.get("architectures") or [None])[0]
        if arch not in LLAMA_ARCHS + MLA_ARCHS:
            raise CheckpointError(
                f"{f}: unsupported draft architecture {arch!r}; mlaserve loads "
                f"{', '.join(LLAMA_ARCHS + MLA_ARCHS + (SPECULATORS_ARCH,))}"
            )
        if int(c.get("num_hidden_layers") or 1) != 1:
            raise CheckpointError(f"{f}: num_hidden_layers={c['num_hidden_layers']}; EAGLE3 drafts have one layer")
        eagle = c.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise CheckpointError(f"{f}: eagle_config.use_aux_hidden_state=false (no fc over aux states) is EAGLE-1/2")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or c.get("eagle_aux_hidden_state_layer_ids")
        n_aux = c.get("num_aux_hidden_states")
        if n_aux is not None and ids and int(n_aux) != len(ids):
            raise CheckpointError(
                f"{f}: num_aux_hidden_states={n_aux} but eagle_aux_hidden_state_layer_ids has {len(ids)} ids"
            )
        n_aux = int(n_aux) if n_aux is not None else (len(ids) if ids else 3)
        if n_aux < 1:
            raise CheckpointError(f"{f}: num_aux_hidden_states must be >= 1, got {n_aux}")
        H = int(c["hidden_size"])
        if n_aux * int(c.get("target_hidden_size") or H) == H:
            raise CheckpointError(
                f"{f}: num_aux_hidden_states={n_aux} x target_hidden_size makes fc's input as wide as hidden_size {H}: "
                "the aux states could not be told from the draft's own hidden states"
            )
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or H // heads)
        rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
        theta = float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0)
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
        else:
            from ..layers.rotary_llama import llama_rope

            try:
                llama_rope(rope, theta, head_dim, int(c.get("max_position_embeddings") or 4096))
            except ValueError as e:
                raise CheckpointError(f"{f}: {e}") from None
        return cls(
            architecture=arch,
            hidden_size=H,
            target_hidden_size=int(c.get("target_hidden_size") or H),
            vocab_size=int(c["vocab_size"]),
            draft_vocab_size=int(c.get("draft_vocab_size") or c["vocab_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(c["intermediate_size"]),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
            tie_word_embeddings=bool(c.get("tie_word_embeddings")),
            mla=mla,
            num_aux_hidden_states=n_aux,
            rope_scaling=tuple(sorted(rope.items())) if mla is None else (),
            max_position_embeddings=int(c.get("max_position_embeddings") or 4096),
            norm_before_residual=bool(c.get("norm_before_residual", False)),
            norm_before_fc=bool(c.get("norm_before_fc", False)),
            fc_norm=bool(c.get("fc_norm", False)),
            norm_output=bool(c.get("norm_output", False)),
            source_format=fmt,
        )


def _from_speculators(c: dict, f: str) -> dict:
    """A speculators config -> the LlamaForCausalLMEagle3 form (vLLM's SpeculatorsConfig + update_eagle3)."""
    kind = c.get("speculators_model_type")
    if kind != "eagle3":
        raise CheckpointError(f"{f}: speculators_model_type {kind!r} is not supported; mlaserve loads 'eagle3'")
    layer = c.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError(f"{f}: transformer_layer_config must be an object (the draft layer's Llama config)")
    if layer.get("model_type", "llama") != "llama":
        raise CheckpointError(
            f"{f}: transformer_layer_config.model_type {layer.get('model_type')!r} is not supported (only llama)"
        )
    out = {**layer, "architectures": [LLAMA_ARCHS[0]]}
    out["norm_before_residual"] = c.get("norm_before_residual", True)
    out.update({k: c[k] for k in _SPECULATORS_FIELDS if c.get(k) is not None})
    return out
