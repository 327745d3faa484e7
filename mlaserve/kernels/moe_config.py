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
# rows per expert (T*K/E) up to which BLOCK_M is 16, 32, 64 (128 above): a block holds an expert's expected rows,
# so each weight tile is read once (benchmarks/moe_prefill_tiles.py); engine/warmup.py warms both sides of each
ROW_BANDS = (16, 32, 64)
FP8_ROW_BANDS = (16, 32)  # the FP8 experts' (kernels/fp8_moe.py): 16-, 32-, then 64-row blocks
INT4_ROW_BANDS = (24, 64)  # the INT4 experts' GEMMs (kernels/int4_moe.gemm_config): 32-, 64-, then 128-row blocks


KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def moe_config(
    T: int, K: int, E: int, D: int, I: int, dtype: torch.dtype, tma: bool = False, **override
) -> tuple[dict, dict]:
    """-> (gemm1 config, gemm2 config). Both share BLOCK_M (the alignment block). `override` (benchmarks, tests)
    replaces keys: flat keys in both, then gemm1={...} / gemm2={...} in one; a BLOCK_M given for one GEMM applies to
    both (they must not disagree). tma: the weight tiles come by TMA (fused_moe.py), which changes the stages."""
    o1, o2 = dict(override.pop("gemm1", None) or {}), dict(override.pop("gemm2", None) or {})
    for where, o in (("", override), ("gemm1.", o1), ("gemm2.", o2)):
        bad = [k for k in o if k not in KEYS]
        if bad:
            raise ValueError(f"moe config keys {[where + k for k in bad]} are not among {KEYS}")
    if "BLOCK_M" in o1 and "BLOCK_M" in o2 and o1["BLOCK_M"] != o2["BLOCK_M"]:
        raise ValueError(
            f"moe config gemm1.BLOCK_M={o1['BLOCK_M']} != gemm2.BLOCK_M={o2['BLOCK_M']}: the GEMMs "
            "share the alignment block"
        )
    bm_override = o1.get("BLOCK_M", o2.get("BLOCK_M", override.get("BLOCK_M")))
    rows_per_expert = T * K / E
    bm = next((b for b in ROW_BANDS if rows_per_expert <= b), 128)
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
        s1 = 4
        if bn1 == 64 and T * K <= E:
            # at most ~one row per expert (batch 1 to 8 on Moonlight with its shared slots: 8 x 22 = 176 programs
            # at N64, 1.3 waves): N32 x 3 stages fits 3 programs per SM, one wave. H200, Moonlight + 2 shared
            # slots over 8 layers' weights (kernels_bench --only moe_decode): T=1 44.5 -> 42.0 us, T=8 179.2 ->
            # 176.2 us, T=4 99.5 -> 99.1; at T=32 (no longer <= E) it was 3 us slower.
            bn1, s1 = 32, 3
        s2 = 4
        if tma:
            # TMA tiles land in shared memory twice as wide as the pointer loads' (compile_check: 80 / 120 KB at
            # 3 / 4 stages), so fewer stages keep 2-3 programs per SM (2 / 3 stages measured best on M1 at batch 1).
            s1, s2 = 2, 3
        c1 = dict(BLOCK_M=16, BLOCK_N=bn1, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=s1)
        c2 = dict(BLOCK_M=16, BLOCK_N=bn2, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=s2)
    elif bm == 32:
        c1 = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
        c2 = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif bm == 64:
        c1 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
        c2 = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        c1 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
        # GEMM2 (N = D, K = I): 128x256 tiles measured 3 % faster than 128x128 for the whole MoE at the M1 8k
        # prefill (H200, kernels_bench moe_sweep, 2026-11-29: 1849 vs 1906 us)
        c2 = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
    c1.update(override, **o1)
    c2.update(override, **o2)
    if bm_override is not None:
        c1["BLOCK_M"] = c2["BLOCK_M"] = bm_override
    return c1, c2
