"""MoE router logits [T, E] fp32 = x [T, D] . W [E, D]^T in exact fp32, reading x as it is (bf16/fp16/fp32, upcast in
registers): no fp32 copy of x and no cuBLAS fp32 GEMM. Same maths as layers.moe.TopkRouter.logits up to the order
of the fp32 sums.

Grid (T blocks, E blocks). Few tokens (decode): FMA products kept per lane in a [BT, BE, BD] accumulator and reduced
once at the end, with few experts per program so the weight streams through many programs at once. Many tokens:
tl.dot with input_precision="ieee" (fp32 FMA, not TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _router_logits_kernel(X, W, Out, T, E, D, stride_xt, stride_we, stride_ot,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                          USE_DOT: tl.constexpr, EVEN_D: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < T
    e_ok = offs_e < E
    x_ptr = X + offs_t.to(tl.int64)[:, None] * stride_xt + offs_d[None, :]  # [BT, BD]
    if USE_DOT:
        w_ptr = W + offs_e.to(tl.int64)[None, :] * stride_we + offs_d[:, None]  # [BD, BE] view
        acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d_ok = offs_d < D - d0
            if EVEN_D:
                x = tl.load(x_ptr, mask=t_ok[:, None], other=0.0)
                w = tl.load(w_ptr, mask=e_ok[None, :], other=0.0)
            else:
                x = tl.load(x_ptr, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
                w = tl.load(w_ptr, mask=d_ok[:, None] & e_ok[None, :], other=0.0)
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
            x_ptr += BLOCK_D
            w_ptr += BLOCK_D
    else:
        w_ptr = W + offs_e.to(tl.int64)[:, None] * stride_we + offs_d[None, :]  # [BE, BD]
        acc3 = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_D], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d_ok = offs_d < D - d0
            if EVEN_D:
                x = tl.load(x_ptr, mask=t_ok[:, None], other=0.0)
                w = tl.load(w_ptr, mask=e_ok[:, None], other=0.0)
            else:
                x = tl.load(x_ptr, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
                w = tl.load(w_ptr, mask=e_ok[:, None] & d_ok[None, :], other=0.0)
            acc3 += x.to(tl.float32)[:, None, :] * w[None, :, :]
            x_ptr += BLOCK_D
            w_ptr += BLOCK_D
        acc = tl.sum(acc3, 2)
    o_ptr = Out + offs_t.to(tl.int64)[:, None] * stride_ot + offs_e[None, :]
    tl.store(o_ptr, acc, mask=t_ok[:, None] & e_ok[None, :])


def router_logits_config(T: int, E: int, D: int) -> dict:
    """Tiles from shapes only. FMA path up to 8 tokens: experts per program such that ~64+ programs stream W."""
    if T <= 8:
        bt = triton.next_power_of_2(max(T, 1))
        be = 1
        while be < 16 and E // (2 * be) >= 64:
            be *= 2
        bd = max(64, min(512, 2048 // (bt * be)))  # a [BT, BE, BD] accumulator of at most 2k fp32
        return dict(BLOCK_T=bt, BLOCK_E=be, BLOCK_D=bd, USE_DOT=False, num_warps=4, num_stages=2)
    if T <= 256:
        return dict(BLOCK_T=16, BLOCK_E=16, BLOCK_D=64, USE_DOT=True, num_warps=4, num_stages=3)
    return dict(BLOCK_T=64, BLOCK_E=max(16, min(64, triton.next_power_of_2(E))), BLOCK_D=32, USE_DOT=True, num_warps=4,
                num_stages=3)


def router_logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """x [T, D] (bf16/fp16/fp32), weight [E, D] fp32 -> logits [T, E] fp32 = F.linear(x.float(), weight)
    (into `out` [T, E] fp32 with a unit last stride if given)."""
    T, D = x.shape
    E = weight.shape[0]
    if weight.dtype != torch.float32 or weight.shape != (E, D):
        raise ValueError(f"router weight must be fp32 [E, {D}], got {weight.dtype} {tuple(weight.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"router input dtype {x.dtype} is not bf16/fp16/fp32")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("router input and weight need a unit last stride")
    if out is None:
        out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    elif out.shape != (T, E) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"router logits out must be fp32 [{T}, {E}] with a unit last stride")
    if T == 0:
        return out
    c = dict(router_logits_config(T, E, D), **(config or {}))
    bt, be, bd = c.pop("BLOCK_T"), c.pop("BLOCK_E"), c.pop("BLOCK_D")
    _router_logits_kernel[(triton.cdiv(T, bt), triton.cdiv(E, be))](
        x, weight, out, T, E, D, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_T=bt, BLOCK_E=be, BLOCK_D=bd, EVEN_D=D % bd == 0, **c)
    return out
