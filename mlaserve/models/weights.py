"""Load HF safetensors checkpoints (single file or sharded index) straight into the model's parameters.

Checkpoint names are HF's. Routed experts arrive one tensor per expert and land stacked per layer;
each parameter's `weight_loader` reads only this rank's shard. FP8 block-scaled weights
(`weight_scale_inv`, DeepSeek-V3/Kimi-K2) and compressed-tensors int4 (`weight_packed`, Kimi-K2.5's routed experts)
are dequantized to the model dtype on load.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

log = logging.getLogger("mlaserve.weights")

EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
# Parts of multimodal wrappers that mlaserve does not serve (vision is out of scope).
SKIPPED_TOWERS = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "vision_model.")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the file and the tensor."""


class _Tensor:
    """A lazily read checkpoint tensor: `.shape` and `[...]` read only the requested slice."""

    def __init__(self, handle, name: str, fp8_scale=None, dtype=None):
        self._slice = handle.get_slice(name)
        self._fp8_scale, self._dtype = fp8_scale, dtype
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, idx):
        if self._fp8_scale is None:
            return self._slice[idx]
        box = _as_box(idx, self.shape)
        if box is None:  # not a plain 2-D box: dequantize everything, then index
            return dequant_fp8_block(self._slice[:], self._fp8_scale, self._dtype)[idx]
        # Read only the shard, and scale it by the blocks it falls in.
        (r0, r1), (c0, c1) = box
        return dequant_fp8_block(self._slice[r0:r1, c0:c1], self._fp8_scale, self._dtype, origin=(r0, c0))


class _PackedInt4:
    """A compressed-tensors `pack-quantized` weight (Kimi-K2.5's routed experts): symmetric int4, eight values per
    int32 along the input dim (value i at bits 4i, stored + 8), one scale per group of inputs. Dequantized whole
    (an expert's matrix is a few MB), then indexed."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, shape, dtype):
        self._packed, self._scale, self._dtype = packed, scale, dtype
        self.shape = tuple(int(x) for x in shape)

    def __getitem__(self, idx):
        return dequant_int4_packed(self._packed, self._scale, self.shape, self._dtype)[idx]


def dequant_int4_packed(packed: torch.Tensor, scale: torch.Tensor, shape, dtype) -> torch.Tensor:
    """packed [out, ceil(in/8)] int32, scale [out, in/group] -> dense [out, in] in `dtype`."""
    out_f, in_f = shape
    shifts = torch.arange(8, dtype=torch.int32) * 4
    q = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(out_f, -1)[:, :in_f] - 8  # [out, in] in [-8, 7]
    group = in_f // scale.shape[1]
    return (q.float() * scale.float().repeat_interleave(group, dim=1)[:, :in_f]).to(dtype)


def _as_box(idx, shape) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """idx as ((row_start, row_stop), (col_start, col_stop)) of a 2-D tensor, if it is unit-step slices."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if len(shape) != 2 or len(idx) > 2 or not all(isinstance(i, slice) for i in idx):
        return None
    idx = idx + (slice(None),) * (2 - len(idx))
    box = tuple(i.indices(n) for i, n in zip(idx, shape))
    return None if any(step != 1 for _, _, step in box) else tuple((a, max(a, b)) for a, b, _ in box)


def dequant_fp8_block(
    w: torch.Tensor, scale_inv: torch.Tensor, dtype, block: int = 128, origin: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """w float8_e4m3fn, rows/cols from `origin` on of a weight whose scale_inv is [ceil(out/128), ceil(in/128)]
    -> dense `dtype`."""
    rows = torch.arange(origin[0], origin[0] + w.shape[0]) // block
    cols = torch.arange(origin[1], origin[1] + w.shape[1]) // block
    s = scale_inv.float()[rows][:, cols]
    return (w.float() * s).to(dtype)


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise CheckpointError(f"{index}: lists {name}, which is not in {path}")
        return [os.path.join(path, f) for f in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (nor model.safetensors.index.json)")
    return files


def _open(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: cannot read safetensors header ({e}); is the file truncated?") from None


def load_weights(model: torch.nn.Module, path: str, progress: bool = True) -> None:
    """Fill every parameter of `model` (a DeepseekV3ForCausalLM) from the checkpoint folder `path`."""
    cfg = model.config
    prefix, n_layers = cfg.weight_prefix, cfg.num_hidden_layers
    params = dict(model.named_parameters())
    experts = {name: mod for name, mod in model.named_modules() if type(mod).__name__ == "Experts"}
    pending = set(params) - {f"{n}.{w}" for n in experts for w in ("gate_up_proj", "down_proj")}
    pending_experts = {
        (n, e, w)
        for n, m in experts.items()
        for e in range(m.expert_offset, m.expert_offset + m.num_local)
        for w in ("gate_proj", "up_proj", "down_proj")
    }
    skipped = {"vision": 0, "mtp": 0}
    dtype = next(iter(params.values())).dtype

    files = checkpoint_files(path)
    handles = [(f, _open(f)) for f in files]
    where = {key: h for _, h in handles for key in h.keys()}  # a weight's scale may sit in another shard
    bar = tqdm(total=len(where), desc="Loading weights", unit="tensor", disable=not progress)
    for file, h in handles:
        for key in sorted(h.keys()):
            bar.update()
            if key.endswith("weight_scale_inv") or _is_int4_companion(key, where):
                continue  # consumed with its weight
            name = key[len(prefix) :] if key.startswith(prefix) else None
            if name is not None and name.endswith(".weight_packed"):
                name = name[: -len("_packed")]  # an int4 weight stands for the dense .weight
            if name is None:
                if key.startswith(SKIPPED_TOWERS):
                    skipped["vision"] += 1
                    continue
                raise CheckpointError(f"{file}: unexpected tensor {key!r} (expected the prefix {prefix!r})")
            m = LAYER_KEY.match(name)
            if m and int(m.group(1)) >= n_layers:
                skipped["mtp"] += 1  # DeepSeek-V3's MTP layer (index num_hidden_layers), unused here
                continue
            try:
                src = _lazy(h, key, where, file, dtype)
            except SafetensorError as e:
                raise CheckpointError(f"{file}: cannot read tensor {key!r} ({e}); is the file truncated?") from None
            em = EXPERT_KEY.match(name)
            try:
                if em:
                    mod_name, e, which = em.group(1), int(em.group(2)), em.group(3)
                    mod = experts.get(mod_name)
                    if mod is None or e >= mod.num_experts:
                        raise CheckpointError(f"{file}: unexpected tensor {key!r} (no such expert in the model)")
                    _check_shape(file, key, src.shape, mod.expert_shape(which))
                    if mod.owns(e):
                        mod.load_expert(e, which, src)
                        pending_experts.discard((mod_name, e, which))
                    continue
                param = params.get(name)
                if param is None:
                    raise CheckpointError(f"{file}: unexpected tensor {key!r} (the model has no such parameter)")
                _check_shape(file, key, src.shape, param.hf_shape)
                param.weight_loader(param, src)
                pending.discard(name)
                mod_name = name.rsplit(".", 1)[0]
                if mod_name in experts:  # transformers 5's fused expert tensors
                    which = ("down_proj",) if name.endswith("down_proj") else ("gate_proj", "up_proj")
                    pending_experts -= {p for p in pending_experts if p[0] == mod_name and p[2] in which}
            except SafetensorError as e:
                raise CheckpointError(f"{file}: cannot read tensor {key!r} ({e}); is the file truncated?") from None
    bar.close()

    if "lm_head.weight" in pending and cfg.tie_word_embeddings and "model.embed_tokens.weight" not in pending:
        params["lm_head.weight"].data.copy_(params["model.embed_tokens.weight"].data)
        pending.discard("lm_head.weight")
    missing = sorted(prefix + n for n in pending) + sorted(f"{prefix}{n}.{e}.{w}.weight" for n, e, w in pending_experts)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r}{more}")
    if skipped["vision"]:
        log.info("skipped %d vision-tower tensors: mlaserve serves the text model only", skipped["vision"])
    if skipped["mtp"]:
        log.info("skipped %d tensors of the MTP layer (layers >= %d)", skipped["mtp"], n_layers)


INT4_COMPANIONS = ("weight_scale", "weight_shape", "weight_zero_point")


def _is_int4_companion(key: str, where: dict) -> bool:
    base, _, last = key.rpartition(".")
    return last in INT4_COMPANIONS and f"{base}.weight_packed" in where


def _lazy(h, key: str, where: dict, file: str, dtype) -> _Tensor:
    if key.endswith(".weight_packed"):
        base = key[: -len("weight_packed")]
        if base + "weight_zero_point" in where:
            raise CheckpointError(
                f"{file}: tensor {key!r} is asymmetric int4 (weight_zero_point); only symmetric "
                "pack-quantized int4 is supported"
            )
        missing = [k for k in ("weight_scale", "weight_shape") if base + k not in where]
        if missing:
            raise CheckpointError(f"{file}: int4 tensor {key!r} has no {base + missing[0]!r}")
        get = lambda k: where[base + k].get_tensor(base + k)  # noqa: E731
        return _PackedInt4(h.get_tensor(key), get("weight_scale"), get("weight_shape").tolist(), dtype)
    scale_key = key[: -len("weight")] + "weight_scale_inv" if key.endswith(".weight") else None
    if scale_key and scale_key in where:
        return _Tensor(h, key, fp8_scale=where[scale_key].get_tensor(scale_key), dtype=dtype)
    if h.get_slice(key).get_dtype().startswith("F8"):
        # Casting fp8 without its block scales would load silently wrong numbers.
        raise CheckpointError(f"{file}: tensor {key!r} is fp8 but the checkpoint has no weight_scale_inv for it")
    return _Tensor(h, key)


def _check_shape(file: str, key: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"{file}: tensor {key!r} has shape {tuple(got)}, expected {tuple(want)}")


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place, without reading files (vLLM's --load-format dummy), scaled as make-random does:
    for benchmarks at shapes whose checkpoints would not fit on disk."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.data.normal_(1.0, 0.1, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            p.data.normal_(0.0, 0.1, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            p.data.normal_(0.0, 1.0, generator=gen)
        else:
            parts = name.split(".")
            kind = parts[-2] if parts[-1] == "weight" else parts[-1]  # e.g. o_proj, or experts' down_proj
            gain = {"o_proj": 0.5, "down_proj": 0.5, "gate": 2.0, "lm_head": 4.0}.get(kind, 1.0)
            p.data.normal_(0.0, gain / p.hf_shape[-1] ** 0.5, generator=gen)
