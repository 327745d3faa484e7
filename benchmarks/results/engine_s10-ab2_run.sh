#!/usr/bin/env bash
# Session 10 A/B 2: MLA batch-1 tiles. main = ff2f0a9 (32-token tiles, 2 stages, <= 64 splits); n16 = 16-token tiles
# and splits, 2 stages, <= 128 splits for batch 1-3. Kernel rows first, then the engine at batch 1, ctx 512 and 8k.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
(cd ab/n16 && PYTHONPATH=$PWD timeout 60 python3 - <<'PY'
import torch, triton
from triton.testing import do_bench_cudagraph
from mlaserve.kernels.mla_decode import mla_decode
from tests.helpers.kernel_refs import mla_decode_ref
from tests.kernel_checks import make_paged
R, P, H = 512, 64, 16
for L in (512, 2048, 8192):
    kv, table, lens = make_paged([L], 64, R + P, torch.bfloat16, "cuda", extra_pages=0)
    q = torch.randn(1, H, R + P, device="cuda").to(torch.bfloat16)
    o = torch.empty(1, H, R, device="cuda", dtype=torch.bfloat16)
    ref = mla_decode_ref(q, kv, table, lens, 1, 0.1, R)
    for name, cfg, S in [("N32 s2 64", dict(BLOCK_N=32, MIN_SPLIT_TOKENS=32), 64), ("N16 s2 64", {}, 64),
                         ("N16 s2 128", {}, 128), ("N16 s3 128", dict(num_stages=3), 128)]:
        us = do_bench_cudagraph(lambda: mla_decode(q, kv, table, lens, 1, 0.1, o, num_splits=S, config=cfg), rep=30) * 1e3
        err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"mla b1 ctx {L:5d} {name:12s} {us:6.2f} us err {err:.1e}")
PY
)
for r in 1 2; do
  for t in main n16; do
    (cd ab/$t && PYTHONPATH=$PWD timeout 100 python3 benchmarks/bench_engine.py --model /tmp/m1 --make moonlight-16b-a3b \
      --label "s10-ab2-$t-r$r" --out "$OUT" --batches 1 --contexts 512,8192 --ttft 512 2>&1 \
      | grep -E "^TPOT|Error|error" | sed "s/^/$t r$r  /") || echo "$t r$r failed"
  done
done
