"""Write HF-format random checkpoints (config.json + sharded safetensors) from a preset, deterministically.

Tensors are listed from the config alone (not from mlaserve's model), so the loader is tested against
the HF layout itself: per-expert keys, `language_model.` under the Kimi-K2.5 wrapper. Quantized checkpoints take
the published forms (`quantization_config`, names, dtypes, shapes): the random weights drawn in the model dtype, then
quantized (INT4: absmax/7 per group of 32; FP8: amax/448 per 128x128 block). The kimi-k2.5 preset is INT4 by
default, as published, and deepseek-v3 FP8 (the presets' `_quantization`).
"""

from __future__ import annotations

import copy
import json
import math
import os
from importlib import resources

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ..config import SUPPORTED_ARCHITECTURES, ModelConfig, torch_dtype
from ..layers.quant import quantize_fp8_block, quantize_int4
from ..quantization import published_config
from ..tokenizer import write_byte_level_tokenizer


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("mlaserve.presets").iterdir() if p.name.endswith(".json"))


def load_preset(name_or_path: str) -> dict:
    if os.path.isfile(name_or_path):
        with open(name_or_path) as f:
            return json.load(f)
    f = resources.files("mlaserve.presets") / f"{name_or_path}.json"
    if not f.is_file():
        raise ValueError(f"unknown preset {name_or_path!r}; choose one of {', '.join(preset_names())} or a path")
    return json.loads(f.read_text())


def hf_tensor_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], float | str]]:
    """(name, shape, init) for every tensor of the text model, its MTP layers (num_nextn_predict_layers) last;
    init is a std, "norm", "bias" or "copy:NAME" (the values of tensor NAME)."""
    D, H, L = cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers
    N, P, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim

    def lin(name, out_f, in_f, gain=1.0):
        return (name, (out_f, in_f), gain / math.sqrt(in_f))

    def mlp(prefix, inter):
        return [
            lin(prefix + "gate_proj.weight", inter, D),
            lin(prefix + "up_proj.weight", inter, D),
            lin(prefix + "down_proj.weight", D, inter, 0.5),
        ]

    def layer(i):
        p = f"model.layers.{i}."
        out = [(p + "input_layernorm.weight", (D,), "norm"), (p + "post_attention_layernorm.weight", (D,), "norm")]
        a = p + "self_attn."
        if cfg.q_lora_rank:
            out += [
                lin(a + "q_a_proj.weight", cfg.q_lora_rank, D),
                (a + "q_a_layernorm.weight", (cfg.q_lora_rank,), "norm"),
                lin(a + "q_b_proj.weight", H * (N + P), cfg.q_lora_rank),
            ]
        else:
            out.append(lin(a + "q_proj.weight", H * (N + P), D))
        out += [
            lin(a + "kv_a_proj_with_mqa.weight", R + P, D),
            (a + "kv_a_layernorm.weight", (R,), "norm"),
            lin(a + "kv_b_proj.weight", H * (N + V), R),
            lin(a + "o_proj.weight", D, H * V, 0.5),
        ]
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            out.append(lin(m + "gate.weight", E, D, 2.0))
            if cfg.has_correction_bias:
                out.append((m + "gate.e_score_correction_bias", (E,), "bias"))
            for e in range(E):
                out += mlp(f"{m}experts.{e}.", I)
            if cfg.n_shared_experts:
                out += mlp(m + "shared_experts.", I * cfg.n_shared_experts)
        else:
            out += mlp(m, cfg.intermediate_size)
        return out

    specs = [("model.embed_tokens.weight", (cfg.vocab_size, D), 1.0)]
    for i in range(L):
        specs += layer(i)
    specs.append(("model.norm.weight", (D,), "norm"))
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    if not cfg.tie_word_embeddings:  # tied: lm_head is embed_tokens, and checkpoints leave it out
        specs.append(lin("lm_head.weight", cfg.vocab_size, D, 4.0))
    for i in range(L, L + cfg.num_nextn_predict_layers):  # DeepSeek-V3's MTP layers, after everything else
        p = f"model.layers.{i}."
        specs += layer(i) + [
            (p + "enorm.weight", (D,), "norm"),
            (p + "hnorm.weight", (D,), "norm"),
            lin(p + "eh_proj.weight", D, 2 * D),
            (p + "shared_head.norm.weight", (D,), "norm"),
            (p + "embed_tokens.weight", (cfg.vocab_size, D), "copy:model.embed_tokens.weight"),  # as published
            (p + "shared_head.head.weight", (cfg.vocab_size, D), "copy:" + head),
        ]
    return specs


def random_tensor(shape, init, gen: torch.Generator, dtype, device) -> torch.Tensor:
    return _draw(shape, init, gen, dtype, device).cpu()


def quantized_tensors(name: str, t: torch.Tensor, method: str) -> dict[str, torch.Tensor]:
    """A linear's `name` (X.weight) and weight t [out, in] -> its tensors in the published form (CPU)."""
    base = name[: -len("weight")]
    if method == "int4":
        packed, scale = quantize_int4(t)
        return {base + "weight_packed": packed.cpu(), base + "weight_scale": scale.cpu()} | {
            base + "weight_shape": torch.tensor(list(t.shape), dtype=torch.int64)
        }
    w, scale_inv = quantize_fp8_block(t)
    return {name: w.cpu(), base + "weight_scale_inv": scale_inv.cpu()}


def _draw(shape, init, gen: torch.Generator, dtype, device) -> torch.Tensor:
    if init == "norm":  # near 1, not exactly, so a mis-loaded norm shows in parity tests
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
    elif init == "bias":  # e_score_correction_bias: big enough to change some expert choices
        t = 0.1 * torch.randn(shape, generator=gen, device=device)
    else:
        t = init * torch.randn(shape, generator=gen, device=device)
    fp32 = init == "bias" or shape == ()  # the routing bias stays fp32, as in real checkpoints
    return t.to(torch.float32 if fp32 else dtype)


def make_random(
    preset: str,
    out: str,
    *,
    layers: int | None = None,
    seed: int = 0,
    dtype: str | None = None,
    shard_bytes: int = 2 << 30,
    device: str = "cpu",
    progress: bool = True,
    overrides: dict | None = None,
    wrapper: bool = False,
    tokenizer: bool = True,
    quantization: str | None = None,
    config_only: bool = False,
    mtp: bool = False,
) -> str:
    """Write config.json, sharded safetensors and the index to `out`. `overrides` update the text config;
    `wrapper` puts a plain text model inside the Kimi-K2.5 wrapper (weights under `language_model.`);
    `quantization` is none | int4-experts | fp8-block (None: the preset's published form); `config_only` writes
    config.json (and the tokenizer) alone, for --load-format dummy; `mtp` writes the preset's MTP layers (at least
    one), after every other tensor, in the published layout (the decoder layer quantized as the others, eh_proj and
    the copies of embed_tokens and lm_head in the model dtype).
    The same seed draws the same numbers for the same tensor list, wrapped or not, quantized or not."""
    raw = copy.deepcopy(load_preset(preset))
    raw.pop("_note", None)
    scheme = raw.pop("_quantization", "none") if quantization is None else quantization
    raw.pop("_quantization", None)
    if raw.get("architectures", [""])[0] not in SUPPORTED_ARCHITECTURES and "text_config" not in raw:
        raise ValueError(f"preset {preset!r} is not a DeepSeek-V3 (or V2) target (use make-random-draft for EAGLE3)")
    if wrapper and "text_config" not in raw:
        raw = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": raw}
    text = raw["text_config"] if "text_config" in raw else raw
    if layers is not None:
        text["num_hidden_layers"] = layers
    text.update(overrides or {})
    if dtype is not None:
        text["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    # MTP layers (DeepSeek-V3's one; the draft of --speculative-algorithm MTP) only when asked for
    text["num_nextn_predict_layers"] = max(int(text.get("num_nextn_predict_layers") or 0), 1) if mtp else 0
    text.pop("quantization_config", None)
    raw.pop("quantization_config", None)
    qc = published_config(scheme)
    if qc is not None:  # where the published checkpoints have it: Kimi-K2.5 in text_config, DeepSeek-V3 on top
        (text if "text_config" in raw else raw)["quantization_config"] = copy.deepcopy(qc)
    cfg = ModelConfig.from_hf(raw, preset)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)
    if not config_only:
        _write_weights(cfg, out, seed, device, shard_bytes, progress)
    # A byte-level tokenizer in which every id decodes, so text in/out works on random weights. Skipped when the
    # vocab cannot hold it (overrides shrinking vocab_size): such a folder works on token ids.
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else 0
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else bos
    if tokenizer and cfg.vocab_size >= 260 and max(bos, eos) < cfg.vocab_size:
        write_byte_level_tokenizer(out, cfg.vocab_size, bos, eos)
    return out


def _write_weights(cfg: ModelConfig, out: str, seed: int, device: str, shard_bytes: int, progress: bool) -> None:
    """The safetensors shards and their index; quantized linears in their published form."""
    quant, tdtype = cfg.quantization, torch_dtype(cfg.torch_dtype)

    gen = torch.Generator(device=device).manual_seed(seed)
    items = []  # (checkpoint key, tensor)
    drawn = {}
    for name, shape, init in tqdm(hf_tensor_specs(cfg), desc="Writing random weights", disable=not progress):
        if isinstance(init, str) and init.startswith("copy:"):
            t = drawn[init[5:]].clone()
        else:
            t = _draw(shape, init, gen, tdtype, device)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            drawn[name] = t
        module = name[: -len(".weight")]
        if quant is not None and name.endswith(".weight") and quant.quantizes(module, cfg.weight_prefix):
            items += quantized_tensors(name, t, quant.method).items()
        else:
            items.append((name, t.cpu()))
    total = sum(t.numel() * t.element_size() for _, t in items)  # the fp32 routing bias counts at its own size
    # Shard on size, with at least two shards so the sharded-index path is always exercised.
    limit = min(shard_bytes, max(total // 2, 1))
    shards, cur, cur_bytes = [], {}, 0
    for key, t in items:
        cur[cfg.weight_prefix + key] = t
        cur_bytes += t.numel() * t.element_size()
        if cur_bytes >= limit:
            shards.append(cur)
            cur, cur_bytes = {}, 0
    if cur:
        shards.append(cur)
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
