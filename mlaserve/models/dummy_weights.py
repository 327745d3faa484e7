"""Random weights in place, without reading files (vLLM's --load-format dummy), scaled as make-random does: for
benchmarks and multi-GPU runs at shapes whose checkpoints would not fit on disk. Quantized layers get random packed
words / FP8 values and scales that give the dequantized weights make-random's spread, in their stored layouts."""

from __future__ import annotations

import torch

from ..layers.fp8_linear import Fp8ExpandedLinear, Fp8Linear
from ..layers.quant import dequant_fp8_block, quantize_fp8_block
from ..layers.quant_experts import Fp8Experts, Int4Experts

GAINS = {"o_proj": 0.5, "down_proj": 0.5, "gate": 2.0, "lm_head": 4.0}  # make-random's, by layer name
INT4_STD = ((16**2 - 1) / 12) ** 0.5  # of q uniform in [-8, 7]


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    # checkpoints store every weight but the routing bias in the model dtype, the router's included, though the
    # model keeps that one in fp32: round it the same way, so that the bf16 router paths (TopkRouter.bf16_weight)
    # run here as they do on loaded checkpoints
    embed = [p for n, p in model.named_parameters() if n.endswith("embed_tokens.weight")]
    ckpt_dtype = embed[0].dtype if embed else None
    quantized = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, Int4Experts):
            _int4_experts(mod, gen)
        elif isinstance(mod, Fp8Experts):
            _fp8(mod.w13, mod.w13_scale_inv, 1.0 / mod.hidden**0.5, gen)
            _fp8(mod.w2, mod.w2_scale_inv, 0.5 / mod.inter**0.5, gen)
        elif isinstance(mod, Fp8Linear):
            gain = GAINS.get(mod_name.rsplit(".", 1)[-1], 1.0)
            _fp8(mod.weight[None], mod.weight_scale_inv[None], gain / mod.weight.hf_shape[1] ** 0.5, gen)
        else:
            continue
        quantized |= {f"{mod_name}.{n}" for n, _ in mod.named_parameters()}
    for name, p in model.named_parameters():
        if name in quantized:
            continue
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.data.normal_(1.0, 0.1, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            p.data.normal_(0.0, 0.1, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            p.data.normal_(0.0, 1.0, generator=gen)
        else:
            parts = name.split(".")
            kind = parts[-2] if parts[-1] == "weight" else parts[-1]  # e.g. o_proj, or experts' down_proj
            p.data.normal_(0.0, GAINS.get(kind, 1.0) / p.hf_shape[-1] ** 0.5, generator=gen)
            if p.dtype == torch.float32 and ckpt_dtype is not None and ckpt_dtype != torch.float32:
                p.data.copy_(p.data.to(ckpt_dtype))
    for mod in model.modules():  # an FP8 weight held dequantized: its block scales as a checkpoint's would be
        if isinstance(mod, Fp8ExpandedLinear):
            w8, scale = quantize_fp8_block(mod.weight.detach())
            mod.weight.data.copy_(dequant_fp8_block(w8, scale).to(mod.weight.dtype))
            mod.weight_scale_inv.data.copy_(scale)
            mod.requantize()


def _scales(s: torch.Tensor, std: float, gen) -> None:
    """Scales around `std` (+-10 %), so the blocks / groups differ."""
    s.data.copy_((std * (1 + 0.1 * torch.randn(s.shape, generator=gen, device=s.device))).to(s.dtype))


def _int4_experts(mod: Int4Experts, gen) -> None:
    for packed, scale, fan_in, gain in (
        (mod.w13_packed, mod.w13_scale, mod.hidden, 1.0),
        (mod.w2_packed, mod.w2_scale, mod.inter, 0.5),
    ):
        for e in range(packed.shape[0]):  # one expert at a time: bounded temporaries
            packed.data[e].random_(-(2**31), 2**31 - 1, generator=gen)  # 8 random nibbles a word
            _scales(scale[e], gain / fan_in**0.5 / INT4_STD, gen)


def _fp8(w: torch.Tensor, scale_inv: torch.Tensor, std: float, gen) -> None:
    """w [E, N, K] float8_e4m3fn: standard-normal values, and scales of `std`."""
    for e in range(w.shape[0]):
        w.data[e].copy_(torch.randn(w.shape[1:], generator=gen, device=w.device, dtype=torch.bfloat16))
        _scales(scale_inv[e], std, gen)
