"""How fast the GPU reads Kimi-K2.5's packed w13 (384 experts x 4096 rows x 896 int32 words, 5.6 GB) in the grouped
INT4 GEMMs' access pattern, against plain streaming: read-only Triton kernels, no arithmetic but an XOR.

- span: each program streams a contiguous span (BLOCK words a step, STEPS steps);
- rows: each program reads ROWS rows and 4 CW bytes of each a step along the whole row, as the GEMMs' programs
  walk their weight rows' K (64-512 bytes a row a step).

    PYTHONPATH=$PWD python benchmarks/int4_read_pattern.py     # JSON to $OUT/int4_read_pattern.json (default out/)

Needs a GPU with ~6 GB free. Median of 8 reads each (int4_moe_tiles.timeit); the buffer (5.6 GB) is far larger than L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from benchmarks.bench_util import save_json
from benchmarks.int4_moe_tiles import timeit

E, R, NW = 384, 4096, 896  # experts, w13 rows (gate | up), words a row (7168 / 8)


@triton.jit
def _span_kernel(W, Out, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    p = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    base = p.to(tl.int64) * BLOCK * STEPS
    for s in range(STEPS):
        o = base + s * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(W + o, mask=o < n, other=0)
    tl.store(Out + p * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def _rows_kernel(W, Out, NW: tl.constexpr, ROWS: tl.constexpr, CW: tl.constexpr):
    p = tl.program_id(0)
    r = p.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, CW], tl.int32)
    for k in range(0, NW, CW):
        acc ^= tl.load(W + r[:, None] * NW + k + tl.arange(0, CW)[None, :])
    tl.store(Out + p * ROWS * CW + tl.arange(0, ROWS)[:, None] * CW + tl.arange(0, CW)[None, :], acc)


def main() -> None:
    w = torch.randint(0, 1 << 30, (E * R, NW), dtype=torch.int32, device="cuda")
    n, nbytes = w.numel(), w.numel() * 4
    out = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    rows = []
    for block, steps, warps in [(4096, 64, 8), (2048, 128, 4)]:
        grid = (triton.cdiv(n, block * steps),)
        ms = timeit(lambda: _span_kernel[grid](w, out, n, block, steps, num_warps=warps))
        rows.append(dict(pattern=f"span {block} words x {steps} steps, {warps} warps", ms=ms, tbps=nbytes / ms / 1e9))
    for nrows, cw, warps in [(256, 16, 8), (128, 16, 4), (256, 32, 8), (256, 64, 8), (64, 64, 4), (32, 128, 4)]:
        grid = (E * R // nrows,)
        ms = timeit(lambda: _rows_kernel[grid](w, out, NW, nrows, cw, num_warps=warps))
        rows.append(dict(pattern=f"rows {nrows} x {4 * cw} B a step, {warps} warps", ms=ms, tbps=nbytes / ms / 1e9))
    for r in rows:
        print(f"{r['pattern']:40s} {r['ms']:.3f} ms {r['tbps']:.2f} TB/s", flush=True)
    save_json("int4_read_pattern.json", rows)


if __name__ == "__main__":
    main()
