#!/usr/bin/env bash
# No compile at serving time, measured: the seed's protocol (docs/benchmarking.md: 8 prompts, concurrency 8, seed
# 20260724, greedy, zero client warm-ups) against a fresh server, twice; the first run's median TTFT must be within
# 10 % of the second's (a kernel compiling in the first run shows up there). M1 shapes (Moonlight-16B-A3B, random
# weights in place), one GPU. Results and the server log (with its "warm-up:" line) under $OUT.
#   bash benchmarks/first_run_ttft.sh                 # plain server, IN=8192 OUTLEN=1024
#   SPEC=1 bash benchmarks/first_run_ttft.sh          # an EAGLE3 K=1 N=2 server with a random draft
OUTLEN=${OUTLEN:-1024}
source benchmarks/serve_lib.sh
m1_dummy "$SPEC"
flags=()
[[ -n "$SPEC" ]] && flags=(--speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/m1-dummy-draft
  --speculative-num-steps 1 --speculative-num-draft-tokens 2)
label=m1-$([[ -n "$SPEC" ]] && echo eagle3 || echo plain)
start_server $label /tmp/m1-dummy --load-format dummy --max-model-len $(( IN + OUTLEN + 64 )) --no-prefix-caching \
  "${flags[@]}" || exit 1
grep -E "captured|warm-up|KV cache" "$OUT/server-$label.log" | cut -c1-240
for run in 1 2; do
  el "bench run $run"
  bench_protocol "$label-run$run" "$OUT/$label-run$run.json"
done
stop_server
python3 - "$OUT/$label-run1.json" "$OUT/$label-run2.json" <<'PY'
import json, sys
first, second = (json.load(open(p))["median_ttft_ms"] for p in sys.argv[1:3])
ratio = first / second
print(f"median TTFT: first run {first:.0f} ms, second run {second:.0f} ms, ratio {ratio:.3f} (must be <= 1.10)")
sys.exit(0 if ratio <= 1.10 else 1)
PY
