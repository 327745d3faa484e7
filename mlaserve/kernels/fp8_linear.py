"""y = x @ dequant(weight)^T for 128x128 block-scaled FP8 weights (DeepSeek-V3/R1, Kimi-K2): one entry point,
three forms chosen by the row count M.

- M <= kernels.fp8_gemv_max_rows (decode, verify): fp8_gemv.py's W8A16 GEMV, the fp8 rows streamed whole and scaled in
  registers. cuBLAS's block-scaled GEMM takes 16.7 us for 8 rows of a 7168 -> 2048 weight (0.9 TB/s, H200, torch
  2.11), far off the weight stream's floor.
- above kernels.fp8_linear_a8_min_tokens rows W8A8 by DeepSeek's recipe: fp8_act_quant (per token, per 128
  channels), then torch's F.scaled_mm(BlockWise1x128, BlockWise128x128) (cuBLASLt's sm_90 kernels) above
  kernels.fp8_scaled_mm_min_rows rows or on weights of kernels.fp8_scaled_mm_min_bytes, else fp8_gemm.py's tiled
  Triton GEMM (fp8 x fp8 MMAs).
- the Triton GEMM's W8A16 form (no quantization launch): rows the GEMV does not take below the edge (a raised
  edge, a forced form), and fp32 x.
The form thresholds are set by kernels_bench --only fp8_linear, which times every form at every M; the W8A8 edge
is where CUDA-graph padding cannot cross it (KernelConfig.fp8_linear_a8_min_tokens).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..kernel_config import KernelConfig
from .fp8_gemm import fp8_gemm
from .fp8_gemv import FP8_GEMV_MAX_ROWS, fp8_gemv
from .fp8_quant import act_quant, fp8_act_quant
from .fp8_reference import BLOCK, dequant_fp8_block, fp8_act_quant_ref, fp8_block_linear_ref
from .silu_mul import silu_mul, silu_mul_quant

__all__ = [
    "fp8_block_linear",
    "fp8_silu_mul_linear",
    "fp8_act_quant",
    "fp8_act_quant_ref",
    "fp8_block_linear_ref",
    "dequant_fp8_block",
    "scaled_mm_serves",
    "linear_form",
]

FORMS = ("gemv", "triton", "scaled_mm")


@functools.cache
def _scaled_mm_device(index: int) -> bool:
    """F.scaled_mm with DeepSeek's (1x128, 128x128) scaling: torch >= 2.10's API, cuBLASLt's sm_90 kernels."""
    return (
        hasattr(F, "scaled_mm")
        and hasattr(getattr(F, "ScalingType", None), "BlockWise1x128")
        and torch.cuda.get_device_capability(index)[0] == 9
    )


def scaled_mm_serves(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> bool:
    """Whether F.scaled_mm's blockwise form takes these operands: sm_90, bf16/fp16 out, N and K multiples of 16
    (cuBLASLt), ceil(K/128) a multiple of 4 and a row-contiguous scale (its transposed view is then the padded
    [round_up(K/128, 4), N/128] operand torch checks for), a row-contiguous weight."""
    N, K = weight.shape
    kb = -(-K // BLOCK)
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and N % 16 == 0
        and K % 16 == 0
        and kb % 4 == 0
        and weight.is_contiguous()
        and weight_scale_inv.is_contiguous()
        and _scaled_mm_device(x.device.index if x.device.index is not None else torch.cuda.current_device())
    )


def _scaled_mm(x, weight, weight_scale_inv, out, pdl: bool):
    """fp8_act_quant (rows padded to 4: cuBLASLt's scale vectors are 16-byte aligned), then F.scaled_mm."""
    q, s = act_quant(x, BLOCK, row_align=4, pdl=pdl)
    return _scaled_mm_q(q, s, weight, weight_scale_inv, x.shape[0], x.dtype, out)


def _scaled_mm_q(q, s, weight, weight_scale_inv, M: int, dtype, out):
    """F.scaled_mm on activations already quantized (q [Mp, K] e4m3, s [Mp, G] with strides (1, Mp), Mp >= M a
    multiple of 4) -> [M, N] in dtype (new, or into `out`)."""
    y = F.scaled_mm(
        q,
        weight.t(),
        s,
        F.ScalingType.BlockWise1x128,
        weight_scale_inv.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=dtype,
    )
    if out is None:
        return y[:M]
    return out.copy_(y[:M])


def linear_form(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    config=None,
    kernels: KernelConfig = KernelConfig(),
) -> tuple[str, bool]:
    """-> (form, a8): the form fp8_block_linear runs (config's "form", else by M and kernels' FP8 thresholds) and
    whether it quantizes x: above kernels.fp8_linear_a8_min_tokens rows (kernel_config.py says why an edge)."""
    cfg = config or {}
    M = x.shape[0]
    big = weight.shape[0] * weight.shape[1] >= kernels.fp8_scaled_mm_min_bytes  # e4m3: one byte a weight
    # fp32 x asks for fp32 products: never W8A8 unless forced (its fp8 MMAs sum K=128 products at the tensor cores'
    # reduced fp8 accumulation precision, and x itself is rounded to 3 mantissa bits)
    a8_default = M > kernels.fp8_linear_a8_min_tokens and x.dtype != torch.float32
    form = cfg.get("form")
    if form is None:
        if M <= min(kernels.fp8_gemv_max_rows, FP8_GEMV_MAX_ROWS) and not a8_default:
            form = "gemv"
        elif (
            a8_default and (M > kernels.fp8_scaled_mm_min_rows or big) and scaled_mm_serves(x, weight, weight_scale_inv)
        ):
            form = "scaled_mm"
        else:
            form = "triton"
    if form not in FORMS:
        raise ValueError(f"config form={form!r} is not one of {FORMS}")
    return form, form == "scaled_mm" or (form == "triton" and bool(cfg.get("a8", a8_default)))


def _check(x, weight, weight_scale_inv, out):
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    N, K = weight.shape
    if weight.dtype != torch.float8_e4m3fn or weight.stride(-1) != 1:
        raise ValueError(f"weight must be float8_e4m3fn with a unit last stride, got {weight.dtype} {weight.stride()}")
    sshape = (-(-N // BLOCK), -(-K // BLOCK))
    if weight_scale_inv.shape != sshape or weight_scale_inv.dtype != torch.float32:
        raise ValueError(
            f"weight_scale_inv must be fp32 {list(sshape)} (128x128 blocks of weight [{N}, {K}]), got "
            f"{weight_scale_inv.dtype} {list(weight_scale_inv.shape)}"
        )
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if not (x.device == weight.device == weight_scale_inv.device):
        raise ValueError(f"x, weight and weight_scale_inv must share a device: {x.device} {weight.device}")
    if out is not None and (out.shape != (x.shape[0], N) or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(
            f"out must be [{x.shape[0]}, {N}] {x.dtype} with a unit last stride, got {tuple(out.shape)} "
            f"{out.dtype} strides {out.stride()}"
        )


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: dict | None = None,
    kernels: KernelConfig = KernelConfig(),
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, any strides) @ dequant(weight e4m3 [N, K], weight_scale_inv fp32 [ceil(N/128),
    ceil(K/128)])^T -> [M, N] in x.dtype (new, or `out`: a view with a unit last stride). Small M computes on x
    itself (W8A16: fp8_block_linear_ref(a8=False)); large M quantizes x per token per 128 channels first (W8A8:
    fp8_block_linear_ref(a8=True)). CUDA only (the CPU path dequantizes). config (benchmarks, tests): "form" (one
    of FORMS), "a8" (the Triton GEMM's form), and fp8_gemv / fp8_gemm tile keys. kernels: pdl and the FP8 thresholds
    (kernel_config.py)."""
    _check(x, weight, weight_scale_inv, out)
    form, a8 = linear_form(x, weight, weight_scale_inv, config, kernels)
    pdl = kernels.pdl
    cfg = {k: v for k, v in (config or {}).items() if k not in ("form", "a8")}
    M, N = x.shape[0], weight.shape[0]
    if form == "gemv" and M > FP8_GEMV_MAX_ROWS:
        raise ValueError(f"form 'gemv' serves up to {FP8_GEMV_MAX_ROWS} rows, got M={M}")
    if M == 0:
        return torch.empty(0, N, dtype=x.dtype, device=x.device) if out is None else out
    if form == "scaled_mm":
        if not scaled_mm_serves(x, weight, weight_scale_inv):
            raise ValueError(
                f"form 'scaled_mm' needs sm_90, bf16/fp16 x, N and K multiples of 16 and ceil(K/128) a multiple of "
                f"4 (N={N}, K={weight.shape[1]}, x {x.dtype})"
            )
        return _scaled_mm(x, weight, weight_scale_inv, out, pdl)
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if form == "gemv":
        return fp8_gemv(x, weight, weight_scale_inv, out, cfg, pdl)
    if a8:
        q, s = act_quant(x, BLOCK, pdl=pdl)
        return fp8_gemm(q, s, weight, weight_scale_inv, out, cfg, pdl)
    return fp8_gemm(x, None, weight, weight_scale_inv, out, cfg, pdl)


def fp8_silu_mul_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    *,
    kernels: KernelConfig = KernelConfig(),
) -> torch.Tensor:
    """fp8_block_linear(silu_mul(gate, up), weight, weight_scale_inv) for an MLP's down projection (gate, up [M, K]
    as silu_mul takes them). Where that would quantize the product (W8A8: scaled_mm, or the Triton GEMM above
    kernels.fp8_linear_a8_min_tokens), silu_mul_quant quantizes it where it is computed and the product is never written
    in x's dtype; same bits as the two steps."""
    _check(gate, weight, weight_scale_inv, None)
    form, a8 = linear_form(gate, weight, weight_scale_inv, None, kernels)
    M, pdl = gate.shape[0], kernels.pdl
    if M and form == "scaled_mm":
        q, s = silu_mul_quant(gate, up, BLOCK, row_align=4, pdl=pdl)
        return _scaled_mm_q(q, s, weight, weight_scale_inv, M, gate.dtype, None)
    if M and form == "triton" and a8:
        q, s = silu_mul_quant(gate, up, BLOCK, pdl=pdl)
        out = torch.empty(M, weight.shape[0], dtype=gate.dtype, device=gate.device)
        return fp8_gemm(q, s, weight, weight_scale_inv, out, {}, pdl)
    return fp8_block_linear(silu_mul(gate, up, pdl), weight, weight_scale_inv, kernels=kernels)
