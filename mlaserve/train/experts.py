"""Routed experts for training: tokens sorted by expert, then one grouped matmul per projection for all experts
(torch._grouped_mm on CUDA in bf16; a loop over experts elsewhere, the reference). Static shapes and no host sync
on the grouped path, so it compiles and runs in one CUDA stream without waits.

DeepSeek-V3's auxiliary-loss-free balancing is `update_bias`: after each optimizer step, each expert's routing
bias moves by gamma towards the mean load (a sign step, not a gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALIGN = 16  # rows of each expert's group start at a multiple of this (grouped_mm's 16-byte alignment in bf16)


def grouped_mm_available(device: torch.device) -> bool:
    """torch._grouped_mm runs bf16 on CUDA with compute capability 9.0 (Hopper) and later."""
    return (
        hasattr(torch, "_grouped_mm") and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm: bool, scaling: float):
    """noaux_tc with one group: logits [T, E] fp32 -> (weights [T, K] fp32, ids [T, K]). The biased score chooses,
    the unbiased sigmoid weighs; the bias gets no gradient."""
    scores = logits.sigmoid()
    ids = (scores.detach() + bias).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def expert_loads(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [T, K] -> tokens routed to each expert [E] fp32 (scatter_add: static shape, compiles)."""
    flat = ids.reshape(-1)
    return torch.zeros(num_experts, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float))


def update_bias(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> None:
    """bias [E] += gamma * sign(mean load - load), in place (DeepSeek-V3's balancing, applied per step)."""
    bias.add_(gamma * torch.sign(load.mean() - load))


def _sorted_rows(ids: torch.Tensor, num_experts: int, padded: bool):
    """Where each (token, k) row goes in the expert-sorted buffer: -> (dest [T*K], offs [E] int32 group ends,
    rows in the buffer). Padded: each group starts at a multiple of ALIGN (buffer T*K + E*ALIGN rows)."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # rows grouped by expert, token order kept inside a group
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    sizes = (counts + ALIGN - 1) // ALIGN * ALIGN if padded else counts
    ends = sizes.cumsum(0)
    starts = ends - sizes
    first = counts.cumsum(0) - counts  # each expert's first row in `order`
    e_sorted = flat[order]
    slot = starts[e_sorted] + torch.arange(flat.numel(), device=ids.device) - first[e_sorted]
    dest = torch.empty_like(slot).scatter_(0, order, slot)  # row (t, k) -> its slot
    rows = flat.numel() + num_experts * ALIGN if padded else flat.numel()
    return dest, ends.to(torch.int32), rows


def _mm_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The reference: x [M, K] rows grouped by offs, w [E, N, K] -> [M, N] (rows past offs[-1] are zero)."""
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], w[e])
        start = end
    return out


def experts_forward(x, w13, w2, weights, ids, grouped: bool) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = ids[t, k].
    x [T, D]; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I]; -> [T, D] in x.dtype."""
    T, K = ids.shape
    E = w13.shape[0]
    dest, offs, rows = _sorted_rows(ids, E, padded=grouped)
    xs = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x.repeat_interleave(K, dim=0))  # [rows, D]
    if grouped:
        dt = torch.bfloat16
        h = torch._grouped_mm(xs.to(dt), w13.to(dt).transpose(-2, -1), offs=offs)  # [rows, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm((F.silu(gate) * up).to(dt), w2.to(dt).transpose(-2, -1), offs=offs)  # [rows, D]
    else:
        h = _mm_loop(xs, w13.to(x.dtype), offs)
        gate, up = h.chunk(2, dim=-1)
        y = _mm_loop(F.silu(gate) * up, w2.to(x.dtype), offs)
    y = y[dest].view(T, K, -1)  # back in (token, k) order
    return (y.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)
