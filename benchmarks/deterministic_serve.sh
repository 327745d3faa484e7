#!/usr/bin/env bash
# Deterministic inference through the server (issue #34): the seed's protocol (docs/benchmarking.md: 8 prompts,
# concurrency 8, seed 20260724, greedy, zero warm-ups) against a plain server and an EAGLE3 K=1 N=2 server (random
# draft), both with --deterministic-inference; the 8 texts and token ids must be identical. M1 shapes
# (Moonlight-16B-A3B, random weights in place), one GPU. Results and server logs under $OUT.
#   bash benchmarks/deterministic_serve.sh            # IN=8192 OUTLEN=8192
source benchmarks/serve_lib.sh
m1_dummy draft
serve_and_bench() {  # $1: label; the rest: extra serve flags
  local label=$1; shift
  start_server $label /tmp/m1-dummy --load-format dummy --deterministic-inference \
    --max-model-len $(( IN + OUTLEN + 64 )) --no-prefix-caching "$@" || return 1
  grep -E "deterministic|warm-up" "$OUT/server-$label.log" | cut -c1-200
  bench_protocol "m1-det-$label" "$OUT/det-$label.json"
  stop_server
}
serve_and_bench plain
serve_and_bench eagle3 --speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/m1-dummy-draft \
  --speculative-num-steps 1 --speculative-num-draft-tokens 2
python3 - "$OUT/det-plain.json" "$OUT/det-eagle3.json" <<'PY'
import json, sys
a, b = ({r["index"]: r for r in json.load(open(p))["requests"]} for p in sys.argv[1:3])
same = [a[i]["success"] and b[i]["success"] and a[i]["text"] == b[i]["text"]
        and a[i]["output_token_ids"] == b[i]["output_token_ids"] for i in sorted(a)]
print(f"plain and EAGLE3 servers, deterministic mode: {sum(same)} of {len(same)} texts identical")
PY
el "done"
