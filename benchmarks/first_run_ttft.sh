#!/usr/bin/env bash
# No compile at serving time, measured: the seed's protocol (docs/benchmarking.md: 8 prompts, concurrency 8, seed
# 20260724, greedy, zero client warm-ups) against a fresh server, twice; the first run's median TTFT must be within
# 10 % of the second's (a kernel compiling in the first run shows up there). M1 shapes (Moonlight-16B-A3B, random
# weights in place), one GPU. Results and the server log (with its "warm-up:" line) under $OUT.
#   bash benchmarks/first_run_ttft.sh                 # plain server, IN=8192 OUTLEN=1024
#   SPEC=1 bash benchmarks/first_run_ttft.sh          # an EAGLE3 K=1 N=2 server with a random draft
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
IN=${IN:-8192}; OUTLEN=${OUTLEN:-1024}; PORT=${PORT:-8000}
mkdir -p "$OUT"
source benchmarks/wheels.sh
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
python3 - <<'PY'
import json, os
from mlaserve.models.make_random import load_preset
from mlaserve.models.make_random_draft import make_random_draft
raw = load_preset("moonlight-16b-a3b"); raw.pop("_note", None)
os.makedirs("/tmp/m1-dummy", exist_ok=True); json.dump(raw, open("/tmp/m1-dummy/config.json", "w"), indent=1)
if os.environ.get("SPEC") and not os.path.exists("/tmp/m1-dummy-draft/config.json"):
    make_random_draft("kimi-k2.5-eagle3", "/tmp/m1-dummy-draft", target="/tmp/m1-dummy", dtype="bfloat16")
print("wrote /tmp/m1-dummy (config only: dummy weights)")
PY
flags=()
[[ -n "$SPEC" ]] && flags=(--speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/m1-dummy-draft
  --speculative-num-steps 1 --speculative-num-draft-tokens 2)
label=m1-$([[ -n "$SPEC" ]] && echo eagle3 || echo plain)
el "starting the server ($label)"
setsid python3 -m mlaserve serve /tmp/m1-dummy --load-format dummy --port $PORT --max-model-len $(( IN + OUTLEN + 64 )) \
  --no-prefix-caching "${flags[@]}" > "$OUT/server-$label.log" 2>&1 &
SERVER=$!
for i in $(seq 1 900); do
  curl -sf http://127.0.0.1:$PORT/health >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { el "server died"; tail -40 "$OUT/server-$label.log"; exit 1; }
  sleep 1
done
el "server up"; grep -E "captured|warm-up|KV cache" "$OUT/server-$label.log" | cut -c1-240
for run in 1 2; do
  el "bench run $run"
  timeout ${BENCH_S:-600} python3 -m mlaserve bench serve --base-url http://127.0.0.1:$PORT --num-prompts 8 \
    --max-concurrency 8 --input-len $IN --output-len $OUTLEN --seed 20260724 --num-warmups 0 --temperature 0 \
    --ignore-eos --disable-tqdm --label "$label-run$run" --save-result "$OUT/$label-run$run.json" 2>&1 \
    | grep -E "Successful|Failed|Median (TTFT|TPOT|E2EL)|Output token throughput"
done
kill -INT $SERVER; sleep 4; kill -9 -$SERVER 2>/dev/null
python3 - "$OUT/$label-run1.json" "$OUT/$label-run2.json" <<'PY'
import json, sys
first, second = (json.load(open(p))["median_ttft_ms"] for p in sys.argv[1:3])
ratio = first / second
print(f"median TTFT: first run {first:.0f} ms, second run {second:.0f} ms, ratio {ratio:.3f} (must be <= 1.10)")
sys.exit(0 if ratio <= 1.10 else 1)
PY
