"""fp32 torch references of the FP8 block-scaled kernels (fp8_linear.py, fp8_moe.py): any device, host loops.

Weights are float8_e4m3fn with fp32 `weight_scale_inv` over 128x128 blocks (DeepSeek-V3's checkpoints):
w[r, c] = float(weight[r, c]) * scale_inv[r // 128, c // 128]. The experts' w13 [E, 2I, D] keeps its gate half's
block rows first, then the up half's: row n < I uses scale row n // 128, row I + n uses ceil(I/128) + n // 128.
W8A8 forms quantize activations per token per 128 channels (s = amax / 448, q = e4m3(x / s)), as DeepSeek does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128  # the checkpoints' weight_block_size and the activations' group
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-10  # an all-zero group gets a tiny scale, not 0 (q = 0 either way, and x / s stays finite)


def dequant_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, half_rows: int | None = None) -> torch.Tensor:
    """w [..., N, K] e4m3, scale_inv [..., ceil(N/128), ceil(K/128)] -> fp32 [..., N, K].
    half_rows = I: w13's layout, rows [0, I) and [I, 2I) each with their own block rows (gate's, then up's)."""
    N, K = w.shape[-2:]
    if half_rows is None:
        rows = torch.arange(N, device=w.device) // BLOCK
    else:
        n = torch.arange(N, device=w.device)
        rows = torch.where(n < half_rows, n // BLOCK, -(-half_rows // BLOCK) + (n - half_rows) // BLOCK)
    cols = torch.arange(K, device=w.device) // BLOCK
    return w.float() * scale_inv.float()[..., rows, :][..., cols]


def act_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax -> the group's scale max(amax, floor) / 448, correctly rounded on every device. (A tensor divided by
    a Python number runs on CUDA as a multiply by its fp32 reciprocal, 1 ulp off the quotient at times: so the
    divisor is a tensor here, as it is (div_rn) in the kernels.)"""
    a = amax.float().clamp_min(AMAX_FLOOR)
    return a / torch.full_like(a, FP8_MAX)


def fp8_act_quant_ref(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q e4m3 [M, K], s fp32 [M, ceil(K/group)]) with x ~= q * s per group: s = max(amax, floor) / 448
    (act_scale), q = e4m3(x / s) (both divisions correctly rounded; round to nearest even; |x / s| <= 448)."""
    M, K = x.shape
    G = -(-K // group)
    xf = F.pad(x.float(), (0, G * group - K)).view(M, G, group)
    s = act_scale(xf.abs().amax(-1))  # [M, G]
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(M, G * group)[:, :K], s


def fp8_act_dequant(q: torch.Tensor, s: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """fp8_act_quant's (q [M, K], s [M, ceil(K/group)]) -> fp32 [M, K]."""
    return q.float() * s.float().repeat_interleave(group, dim=1)[:, : q.shape[1]]


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, a8: bool = False):
    """x [M, K] @ dequant(weight [N, K])^T in fp32 -> [M, N] fp32. a8: x quantized per token per 128 channels
    first (the W8A8 form's maths)."""
    xf = fp8_act_dequant(*fp8_act_quant_ref(x)) if a8 else x.float()
    return xf @ dequant_fp8_block(weight, scale_inv).T


def fp8_fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    a8: bool = False,
    h_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """sum_k w[t,k] * down_e(silu(gate_e(x[t])) * up_e(x[t])) over the pairs whose expert is local, in fp32 on the
    dequantized weights -> [T, D] fp32. a8: x and the intermediate h quantized per token per 128 channels before
    their GEMMs (the W8A8 form's maths), as the kernel does: h = silu(gate) * up in fp32, never rounded to x's
    dtype, quantized per (row, 128-channel group) with fp8_act_quant_ref's scale (act_scale: a correctly rounded
    division, as the kernel's div_rn). Quantizing h amplifies any difference in it: a relative difference d moves
    the result by about sqrt(d * 0.09) (codes flip where h sits near an e4m3 rounding boundary), so the two must
    compute h and its scales the same way, not merely closely. h_dtype (a8): h rounded to it before its
    quantization, as the W8A8 form whose GEMM1 tiles are narrower than a group writes it (and DeepSeek's own
    inference and vLLM's fused MoE round it)."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    xf = fp8_act_dequant(*fp8_act_quant_ref(x)) if a8 else x.float()
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_offset
    owned = (local >= 0) & (local < E)
    for e in torch.unique(local[owned]).tolist():  # host sync: fine for a reference
        tok, k = torch.where(local == e)
        gu = xf[tok] @ dequant_fp8_block(w13[e], w13_scale_inv[e], half_rows=I).T  # [n, 2I]
        h = F.silu(gu[:, :I]) * gu[:, I:]
        if a8:
            h = fp8_act_dequant(*fp8_act_quant_ref(h if h_dtype is None else h.to(h_dtype).float()))
        y = h @ dequant_fp8_block(w2[e], w2_scale_inv[e]).T  # [n, D]
        out.index_add_(0, tok, y * topk_weights[tok, k, None].float())
    return out


def make_fp8_weight(N: int, K: int, E: int | None = None, *, device="cpu", half_rows: int | None = None):
    """A random block-quantized weight as the checkpoints hold one: (w e4m3 [N, K], scale_inv fp32 [ceil(N/128),
    ceil(K/128)]), or [E, ...] of both; each 128x128 block scaled by its own amax. Blocks differ in magnitude
    (x0.25 .. x4), so a kernel that applies the wrong block's scale is caught. half_rows = I: w13's split layout.
    Experts are made one at a time (fp32 temporaries of one expert only)."""
    if E is not None:
        gn = 2 * -(-half_rows // BLOCK) if half_rows is not None else -(-N // BLOCK)
        w = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(E, gn, -(-K // BLOCK), dtype=torch.float32, device=device)
        for e in range(E):
            w[e], s[e] = make_fp8_weight(N, K, device=device, half_rows=half_rows)
        return w, s
    gk = -(-K // BLOCK)
    n = torch.arange(N, device=device)
    if half_rows is None:
        rows, gn = n // BLOCK, -(-N // BLOCK)
    else:
        gh = -(-half_rows // BLOCK)
        rows, gn = torch.where(n < half_rows, n // BLOCK, gh + (n - half_rows) // BLOCK), 2 * gh
    spread = torch.exp2(torch.randint(-2, 3, (gn, gk), device=device).float())
    w = F.pad(torch.randn(N, K, device=device) * K**-0.5, (0, gk * BLOCK - K))  # [N, gk*128]
    w = w * spread[rows].repeat_interleave(BLOCK, 1)
    blk = w.abs().view(N, gk, BLOCK).amax(-1)  # [N, gk]
    amax = torch.zeros(gn, gk, device=device).scatter_reduce_(0, rows[:, None].expand(N, gk), blk, "amax")
    scale = act_scale(amax)
    q = (w / scale[rows].repeat_interleave(BLOCK, 1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q[:, :K].contiguous(), scale
