"""Greedy sampling's arg-max over the vocabulary, in two launches: torch.argmax(-1) exactly, faster on long rows.

torch reduces a [1, 163840] row in one thread block (8.3 us on the H200, after every decode step at batch 1);
here each row is cut into blocks of BLOCK values, each program reduces one block to (its max, the first index of
it), and one program per row reduces those. torch's rules hold: the FIRST index of the maximum wins, and a NaN
counts as larger than everything (the first NaN's index wins). With `offsets` (an EAGLE3 draft's d2t) the second
launch writes i + offsets[i], the draft id mapped to the target's, where torch takes two more launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_release, pdl_start, pdl_wait

BLOCK = 4096  # values a first-stage program reduces: 40 programs a row for Kimi's / Moonlight's 163840 tokens


@triton.jit
def _first_max(v, idx, ok):
    """(max, first index of it) of v [N] over the lanes ok, with NaN above everything -> (value, index)."""
    nan = (v != v) & ok
    any_nan = tl.max(nan.to(tl.int32), 0) > 0
    m = tl.max(tl.where(ok & ~nan, v, float("-inf")), 0)
    hit = tl.where(any_nan, nan, ok & (v == m))
    first = tl.min(tl.where(hit, idx, 2147483647), 0)  # idx < V < 2^31
    return tl.where(any_nan, float("nan"), m), first


@triton.jit
def _argmax_blocks_kernel(X, PartV, PartI, V, NB, stride_xb, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row b, block j): PartV/PartI[b, j] = the block's (max, first index of it)."""
    pdl_start(PDL)  # resident while the lm_head ends (pdl.py); the logits are its output
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    idx = j * BLOCK + tl.arange(0, BLOCK)
    ok = idx < V
    v = tl.load(X + b * stride_xb + idx, mask=ok).to(tl.float32)  # exact for bf16/fp16; masked lanes: _first_max
    m, first = _first_max(v, idx, ok)
    tl.store(PartV + b * NB + j, m)
    tl.store(PartI + b * NB + j, first)


@triton.jit
def _argmax_rows_kernel(
    PartV,
    PartI,
    Out,
    Offsets,
    Host,
    HostRow,
    NB,
    stride_out,
    stride_host,
    BLOCK_NB: tl.constexpr,
    OFFSETS: tl.constexpr,
    HOST: tl.constexpr,
    HOST_ROW: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program b: Out[b] = the index i of row b's first maximum, from its blocks' (max, first index): block j's
    indices all precede block j+1's, so the first block holding the row's max (or a NaN) has the answer. OFFSETS:
    Out[b] = i + Offsets[i].
    HOST: also Host[r, b] with r = HostRow[0] (HOST_ROW) or 0: pinned host memory written over the bus, so no copy
    launch follows, and from inside a CUDA graph (the row, read at run time, picks a slot of a ring)."""
    pdl_release(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_NB)
    ok = j < NB
    if HOST and HOST_ROW:  # a step input the host copied before the forward: safe before the wait (pdl.py)
        r = tl.load(HostRow).to(tl.int64)
    else:
        r = 0
    pdl_wait(PDL)
    v = tl.load(PartV + b * NB + j, mask=ok, other=float("-inf"))
    _, jb = _first_max(v, j, ok)
    tok = tl.load(PartI + b * NB + jb).to(tl.int64)
    if OFFSETS:
        tok += tl.load(Offsets + tok)
    tl.store(Out + b * stride_out, tok)
    if HOST:
        tl.store(Host + r * stride_host + b, tok)


def argmax_rows(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    host: torch.Tensor | None = None,
    host_row: torch.Tensor | None = None,
    pdl: bool = True,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [B, V] fp32/bf16/fp16 (a unit last stride) -> out [B] int64 (given, any stride, or new), equal to
    x.argmax(-1); with offsets (int64 [V] on x's device): i + offsets[i] of that i.
    host: pinned CPU int64 the kernel also writes: [B], or a ring [R, >= B] whose row host_row (an int32 [1] on
    x's device, read when the kernel runs) it writes. Read it after an event recorded behind this call."""
    if x.dim() != 2 or x.stride(-1) != 1 or not x.is_floating_point():
        raise ValueError(
            f"argmax_rows needs a float [B, V] tensor with a unit last stride, got "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    B, V = x.shape
    if V == 0 or V >= 2**31:
        raise ValueError(f"argmax_rows: V={V} must be in [1, 2^31)")
    if out is not None and (out.shape != (B,) or out.dtype != torch.int64 or out.device != x.device):
        raise ValueError(f"argmax_rows: out must be an int64 [{B}] on {x.device}, got {tuple(out.shape)} {out.dtype}")
    if offsets is not None and (offsets.shape != (V,) or offsets.dtype != torch.int64 or offsets.device != x.device):
        raise ValueError(
            f"argmax_rows: offsets must be an int64 [{V}] on {x.device}, got {tuple(offsets.shape)} {offsets.dtype}"
        )
    if host is not None:
        shape_ok = host.shape == (B,) if host_row is None else (host.dim() == 2 and host.shape[1] >= B)
        if not shape_ok or host.dtype != torch.int64 or host.stride(-1) != 1 or host.device.type != "cpu":
            raise ValueError(
                f"argmax_rows: host must be a CPU int64 {'[B]' if host_row is None else '[R, >= B]'} "
                f"with B={B}, got {tuple(host.shape)} {host.dtype} on {host.device}"
            )
        if x.is_cuda and not host.is_pinned():
            raise ValueError("argmax_rows: host must be pinned memory (the GPU writes it directly)")
    if host_row is not None and (host is None or host_row.numel() != 1 or host_row.device != x.device):
        raise ValueError("argmax_rows: host_row needs host, and must be one value on x's device")
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return out
    nb = triton.cdiv(V, BLOCK)
    part_v = torch.empty(B, nb, dtype=torch.float32, device=x.device)
    part_i = torch.empty(B, nb, dtype=torch.int32, device=x.device)
    _argmax_blocks_kernel[(B, nb)](x, part_v, part_i, V, nb, x.stride(0), BLOCK=BLOCK, num_warps=8, **pdl_args(x, pdl))
    _argmax_rows_kernel[(B,)](
        part_v,
        part_i,
        out,
        out if offsets is None else offsets,
        out if host is None else host,
        out if host_row is None else host_row,
        nb,
        out.stride(0),
        0 if host is None or host_row is None else host.stride(0),
        BLOCK_NB=max(2, triton.next_power_of_2(nb)),
        OFFSETS=offsets is not None,
        HOST=host is not None,
        HOST_ROW=host_row is not None,
        num_warps=1,
        **pdl_args(x, pdl),
    )
    return out
