"""Tile configs for the fused MoE GEMMs, chosen from shapes only (static under CUDA graphs).

The regime is set by the expected rows per expert, T*K/E:
- few rows (decode, verify, small batches): the GEMMs are weight-streaming GEMVs. BLOCK_M=16 (the smallest tile
  tl.dot takes), long K tiles and deep pipelines, and BLOCK_N shrunk until the active experts' tiles cover the
  132 SMs; only the selected experts' blocks exist, so only their weights are read.
- many rows (prefill): compute bound. 128x128 tiles per weight matrix (GEMM1 holds gate and up: 128x256 of
  output), BLOCK_K=64, 8 warps, GROUP_M=8 row blocks sharing a weight tile in L2 - the shapes vLLM tunes to for
  H100 at large M. Middle sizes step between the two.
"""

from __future__ import annotations

import torch

SMS = 132  # H100/H200; the fill heuristic only needs the order of magnitude


def moe_config(T: int, K: int, E: int, D: int, I: int, dtype: torch.dtype, **override) -> tuple[dict, dict]:
    """-> (gemm1 config, gemm2 config). Both share BLOCK_M (the alignment block). `override` replaces keys in
    both (for benchmarks sweeping configs)."""
    rows_per_expert = T * K / E
    if rows_per_expert <= 16:
        bm = 16
    elif rows_per_expert <= 48:
        bm = 32
    elif rows_per_expert <= 160:
        bm = 64
    else:
        bm = 128
    if dtype == torch.float32:  # tests: IEEE fp32 dots, twice the bytes per element
        c1 = dict(BLOCK_M=bm, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
        c2 = dict(c1)
    elif bm == 16:
        active = min(T * K, E)
        bn1 = 64
        while bn1 > 16 and active * -(-I // bn1) < SMS:
            bn1 //= 2
        bn2 = 64
        while bn2 > 16 and active * -(-D // bn2) < SMS:
            bn2 //= 2
        c1 = dict(BLOCK_M=16, BLOCK_N=bn1, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
        c2 = dict(BLOCK_M=16, BLOCK_N=bn2, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif bm == 32:
        c1 = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
        c2 = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif bm == 64:
        c1 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
        c2 = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        c1 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
        c2 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
    c1.update(override)
    c2.update(override)
    return c1, c2
