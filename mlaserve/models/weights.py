"""Load HF safetensors checkpoints (single file or sharded index) straight into the model's parameters.

Checkpoint names are HF's. Routed experts arrive one tensor per expert and projection and land stacked per layer.
Each parameter's `weight_loader` (an expert block's `load_expert`) reads only this rank's slice, and only of the
experts this rank keeps. Quantized checkpoints load as stored: FP8 weights with their block scales, packed INT4
words with their group scales (layers/fp8_linear.py, layers/quant_experts.py). The one expansion, an FP8 kv_b_proj
dequantized into the model dtype, is logged with the bytes it costs. A tensor that does not fit the model is one
CheckpointError naming the file, the tensor and why.
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

from ..layers.fp8_linear import Fp8ExpandedLinear
from ..layers.moe import ExpertsBase
from ..layers.quant import BLOCK
from ..layers.quant_experts import Fp8Experts, Int4Experts
from .deepseek_mtp import SHARED_WITH_TARGET
from .dummy_weights import init_dummy_weights  # noqa: F401  (--load-format dummy: the loader without files)

log = logging.getLogger("mlaserve.weights")

EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
# Parts of multimodal wrappers that mlaserve does not serve (vision is out of scope).
SKIPPED_TOWERS = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "vision_model.")
# Companions of quantized weights that carry a scheme mlaserve does not compute.
REFUSED = {
    "weight_zero_point": "asymmetric INT4 (a zero point); mlaserve computes symmetric pack-quantized int4",
    "weight_g_idx": "act-order INT4 (a group index); mlaserve computes int4 with groups in input order",
    "input_scale": "a static activation scale; mlaserve quantizes activations dynamically",
}
WEIGHT_SUFFIXES = ("weight", "weight_scale_inv", "weight_packed", "weight_scale", "weight_shape")  # of any format
KIND = {"dense": "an unquantized weight", "fp8": "an FP8 block-scaled weight", "int4": "a packed INT4 weight"}
QUANT_DTYPES = {  # suffix -> safetensors dtypes a quantized tensor may have
    ("fp8", "weight"): ("F8_E4M3",),
    ("fp8", "weight_scale_inv"): ("F32",),
    ("int4", "weight_packed"): ("I32",),
    ("int4", "weight_scale"): ("BF16",),
    ("int4", "weight_shape"): ("I64", "I32"),
}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the file and the tensor."""


class _Tensor:
    """A lazily read checkpoint tensor: `.shape` and `[...]` read only the requested slice. With `fp8_scale` (the
    weight's weight_scale_inv) a slice comes back dequantized into `dtype` (the one expansion: kv_b_proj)."""

    def __init__(self, handle, name: str, fp8_scale=None, dtype=None):
        self._slice = handle.get_slice(name)
        self._fp8_scale, self._dtype = fp8_scale, dtype
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, idx):
        if self._fp8_scale is None:
            return self._slice[idx]
        box = _as_box(idx, self.shape)
        if box is None:  # not a plain 2-D box: dequantize everything, then index
            return _dequant_box(self._slice[:], self._fp8_scale, self._dtype)[idx]
        (r0, r1), (c0, c1) = box  # read only the shard, and scale it by the blocks it falls in
        return _dequant_box(self._slice[r0:r1, c0:c1], self._fp8_scale, self._dtype, origin=(r0, c0))


def _as_box(idx, shape) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """idx as ((row_start, row_stop), (col_start, col_stop)) of a 2-D tensor, if it is unit-step slices."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if len(shape) != 2 or len(idx) > 2 or not all(isinstance(i, slice) for i in idx):
        return None
    idx = idx + (slice(None),) * (2 - len(idx))
    box = tuple(i.indices(n) for i, n in zip(idx, shape))
    return None if any(step != 1 for _, _, step in box) else tuple((a, max(a, b)) for a, b, _ in box)


def _dequant_box(w: torch.Tensor, scale_inv: torch.Tensor, dtype, origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Rows/cols of an FP8 weight from `origin` on, scaled by the blocks they fall in -> `dtype`."""
    rows = torch.arange(origin[0], origin[0] + w.shape[0]) // BLOCK
    cols = torch.arange(origin[1], origin[1] + w.shape[1]) // BLOCK
    return (w.float() * scale_inv.float()[rows][:, cols]).to(dtype)


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


def load_weights(model: torch.nn.Module, path: str, progress: bool = True, mtp: bool = False) -> None:
    """Fill every parameter of `model` (a DeepseekV3ForCausalLM) from the checkpoint folder `path`. mtp: `model` is
    the checkpoint's MTP layer (a DeepseekMTP, models/deepseek_mtp.py), which reads layer num_hidden_layers alone."""
    loader = _Loader(model, mtp)
    handles = [(f, _open(f)) for f in checkpoint_files(path)]
    loader.where = {key: h for _, h in handles for key in h.keys()}  # a weight's scale may sit in another shard
    bar = tqdm(total=len(loader.where), desc="Loading weights", unit="tensor", disable=not progress)
    for file, h in handles:
        for key in sorted(h.keys()):
            bar.update()
            try:
                loader.load(file, h, key)
            except SafetensorError as e:
                raise CheckpointError(f"{file}: cannot read tensor {key!r} ({e}); is the file truncated?") from None
    bar.close()
    loader.finish(path)
    for m in model.modules():  # kv_b_proj's FP8 copy, from the held weight and the checkpoint's scales
        if isinstance(m, Fp8ExpandedLinear):
            m.requantize()


class _Loader:
    """One load's state: the model's parameters and expert blocks, what is still missing, what was skipped."""

    def __init__(self, model: torch.nn.Module, mtp: bool = False):
        self.model, self.cfg, self.mtp = model, model.config, mtp
        self.experts = {n: m for n, m in model.named_modules() if isinstance(m, ExpertsBase)}
        # quantized experts load per expert only; the bf16 block also takes transformers 5's fused tensors by name
        self.params = {
            n: p
            for n, p in model.named_parameters()
            if not isinstance(self.experts.get(n.rsplit(".", 1)[0]), (Int4Experts, Fp8Experts))
        }
        self.pending = {n for n in self.params if n.rsplit(".", 1)[0] not in self.experts}
        self.pending_experts = {
            (n, e, w, s)
            for n, m in self.experts.items()
            for e in range(m.expert_offset, m.expert_offset + m.num_local)
            for w in ("gate_proj", "up_proj", "down_proj")
            for s in m.suffixes
        }
        self.dtype = next(p.dtype for n, p in model.named_parameters() if n.endswith("norm.weight"))
        self.skipped = {"vision": 0, "mtp": 0, "target": 0, "shared": 0}
        self.expanded: list[tuple[str, int, int]] = []  # (name, bytes held, bytes in the checkpoint)
        self.where: dict = {}

    def load(self, file: str, h, key: str) -> None:
        prefix = self.cfg.weight_prefix
        name = key[len(prefix) :] if key.startswith(prefix) else None
        if name is None:
            if key.startswith(SKIPPED_TOWERS):
                self.skipped["vision"] += 1
                return
            raise CheckpointError(f"{file}: unexpected tensor {key!r} (expected the prefix {prefix!r})")
        m = LAYER_KEY.match(name)
        layer, L = (int(m.group(1)) if m else -1), self.cfg.num_hidden_layers
        if not self.mtp and layer >= L:
            self.skipped["mtp"] += 1  # DeepSeek-V3's MTP layer (index num_hidden_layers): the MTP draft's
            return
        if self.mtp and layer != L:  # the target's tensors, and MTP layers past the first (the draft uses one)
            self.skipped["target" if layer < L else "mtp"] += 1
            return
        if self.mtp and name[m.end() :] in SHARED_WITH_TARGET:
            self.skipped["shared"] += 1  # copies of the target's embedding and lm_head
            return
        suffix = name.rpartition(".")[2]
        if suffix in REFUSED:
            raise CheckpointError(f"{file}: tensor {key!r} is {REFUSED[suffix]}")
        em = EXPERT_KEY.match(name)
        if em:
            self.load_expert(file, h, key, em.group(1), int(em.group(2)), em.group(3), em.group(4))
        else:
            self.load_param(file, h, key, name, suffix)

    def load_expert(self, file, h, key, mod_name, e, which, suffix) -> None:
        mod = self.experts.get(mod_name)
        if mod is None or e >= mod.num_experts:
            raise CheckpointError(f"{file}: unexpected tensor {key!r} (no such expert in the model)")
        if suffix not in WEIGHT_SUFFIXES:  # a bias, or a part no format has
            raise CheckpointError(f"{file}: unexpected tensor {key!r} (the model has no such parameter)")
        got = _kind(suffix, h.get_slice(key).get_dtype())
        want = "int4" if isinstance(mod, Int4Experts) else "fp8" if isinstance(mod, Fp8Experts) else "dense"
        if got != want:  # each format's parts are its kind's (_kind), so its suffixes are the block's
            raise self.mismatch(file, key, h, got, want)
        src = _Tensor(h, key)  # the header only: nothing is read before the slice is taken
        _check_shape(file, key, src.shape, mod.expert_shape(which, suffix))
        _check_dtype(file, key, h, got, suffix)
        if not mod.owns(e):
            return  # another rank's expert (EP): nothing of it is read
        if suffix == "weight_shape":  # (out, in) of the unpacked weight
            _check_weight_shape(file, key, src, ExpertsBase.expert_shape(mod, which))
        mod.load_expert(e, which, suffix, src)
        self.pending_experts.discard((mod_name, e, which, suffix))

    def load_param(self, file, h, key, name, suffix) -> None:
        base = name.rpartition(".")[0]
        got = _kind(suffix, h.get_slice(key).get_dtype())
        param = self.params.get(name)
        if param is None:
            sibling = self.params.get(base + ".weight")
            if suffix == "weight_scale_inv" and sibling is not None and getattr(sibling, "expand_fp8", False):
                return  # consumed with its weight
            if got != "dense" and sibling is not None:
                raise self.mismatch(file, key, h, got, _param_kind(base + ".weight", sibling))
            raise CheckpointError(f"{file}: unexpected tensor {key!r} (the model has no such parameter)")
        want = _param_kind(name, param)
        if got == "fp8" and want == "dense" and getattr(param, "expand_fp8", False):
            src = self.expand(file, h, key, param)
        elif got != want:
            raise self.mismatch(file, key, h, got, want)
        else:
            _check_dtype(file, key, h, got, suffix)
            src = _Tensor(h, key)
        _check_shape(file, key, src.shape, param.hf_shape)
        param.weight_loader(param, src)
        self.pending.discard(name)
        mod = self.experts.get(base)
        if mod is not None:  # transformers 5's fused expert tensors
            which = ("down_proj",) if name.endswith("down_proj") else ("gate_proj", "up_proj")
            self.pending_experts -= {p for p in self.pending_experts if p[0] == base and p[2] in which}

    def expand(self, file, h, key, param) -> _Tensor:
        """An FP8 weight held in the model dtype (kv_b_proj): read lazily and dequantized slice by slice."""
        scale_key = key + "_scale_inv"
        if scale_key not in self.where:
            raise CheckpointError(f"{file}: tensor {key!r} is fp8 but the checkpoint has no weight_scale_inv for it")
        scale = self.where[scale_key].get_tensor(scale_key)
        src = _Tensor(h, key, fp8_scale=scale, dtype=param.dtype)
        n = param.numel()  # this rank's rows: its FP8 bytes and their share of the scales
        stored = n + scale.numel() * scale.element_size() * param.shape[0] // src.shape[0]
        self.expanded.append((key, n * param.element_size(), stored))
        return src

    def mismatch(self, file, key, h, got: str, want: str) -> CheckpointError:
        q = self.cfg.quantization
        why = f"config.json's quantization_config is {q.describe()}" if q else "config.json has no quantization_config"
        dtype = h.get_slice(key).get_dtype()
        return CheckpointError(
            f"{file}: tensor {key!r} is {KIND[got]} ({dtype}), but the model holds {KIND[want]} there ({why})"
        )

    def finish(self, path: str) -> None:
        cfg, params = self.cfg, self.params
        if (
            "lm_head.weight" in self.pending
            and cfg.tie_word_embeddings
            and "model.embed_tokens.weight" not in (self.pending)
        ):
            params["lm_head.weight"].data.copy_(params["model.embed_tokens.weight"].data)
            self.pending.discard("lm_head.weight")
        prefix = cfg.weight_prefix
        missing = sorted(prefix + n for n in self.pending) + sorted(
            f"{prefix}{n}.{e}.{w}.{s}" for n, e, w, s in self.pending_experts
        )
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{path}: missing tensor {missing[0]!r}{more}")
        if self.skipped["vision"]:
            log.info("skipped %d vision-tower tensors: mlaserve serves the text model only", self.skipped["vision"])
        if self.skipped["mtp"] and not self.mtp:
            log.info("skipped %d tensors of the MTP layer (layers >= %d)", self.skipped["mtp"], cfg.num_hidden_layers)
        if self.mtp:
            log.info(
                "MTP layer %d loaded; its copies of the target's embedding and lm_head (%d tensors) not read: the "
                "target's are used%s",
                cfg.num_hidden_layers,
                self.skipped["shared"],
                f"; {self.skipped['mtp']} tensors of further MTP layers skipped" if self.skipped["mtp"] else "",
            )
        if self.expanded:
            held, stored = sum(e[1] for e in self.expanded), sum(e[2] for e in self.expanded)
            log.info(
                "expanded %d FP8 tensors (%s) to %s at load, for the absorbed MLA projections: %.1f MB held for "
                "%.1f MB in the checkpoint (+%.1f MB on this rank)",
                len(self.expanded),
                ", ".join(sorted({k.rsplit(".", 2)[-2] for k, _, _ in self.expanded})),
                str(self.dtype).removeprefix("torch."),
                held / 1e6,
                stored / 1e6,
                (held - stored) / 1e6,
            )


def _kind(suffix: str, dtype: str) -> str:
    """What a checkpoint tensor is: part of an FP8 weight, of a packed INT4 weight, or unquantized."""
    if suffix == "weight_scale_inv" or (suffix == "weight" and dtype.startswith("F8")):
        return "fp8"
    if suffix in ("weight_packed", "weight_scale", "weight_shape"):
        return "int4"
    return "dense"


def _param_kind(name: str, param) -> str:
    """What a parameter outside the quantized expert blocks holds (INT4 lives only in those, loaded per expert)."""
    if name.endswith("weight_scale_inv") or param.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    return "dense"


def _check_dtype(file: str, key: str, h, kind: str, suffix: str) -> None:
    want = QUANT_DTYPES.get((kind, suffix))
    got = h.get_slice(key).get_dtype()
    if want is not None and got not in want:
        raise CheckpointError(f"{file}: tensor {key!r} has dtype {got}, expected {' or '.join(want)}")


def _check_weight_shape(file: str, key: str, src, want) -> None:
    got = tuple(int(x) for x in src[:].tolist())
    if got != tuple(want):
        raise CheckpointError(f"{file}: tensor {key!r} says the weight is {got}, expected {tuple(want)}")


def _check_shape(file: str, key: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"{file}: tensor {key!r} has shape {tuple(got)}, expected {tuple(want)}")
