#!/usr/bin/env bash
# Deterministic inference through the server (issue #34): the seed's protocol (docs/benchmarking.md: 8 prompts,
# concurrency 8, seed 20260724, greedy, zero warm-ups) against a plain server and an EAGLE3 K=1 N=2 server (random
# draft), both with --deterministic-inference; the 8 texts and token ids must be identical. M1 shapes
# (Moonlight-16B-A3B, random weights in place), one GPU. Results and server logs under $OUT.
#   bash benchmarks/deterministic_serve.sh            # IN=8192 OUTLEN=8192
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
IN=${IN:-8192}; OUTLEN=${OUTLEN:-8192}; PORT=${PORT:-8000}
mkdir -p "$OUT"
source benchmarks/wheels.sh
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
python3 - <<'PY'
import json, os
from mlaserve.models.make_random import load_preset
from mlaserve.models.make_random_draft import make_random_draft
raw = load_preset("moonlight-16b-a3b"); raw.pop("_note", None)
os.makedirs("/tmp/m1-dummy", exist_ok=True); json.dump(raw, open("/tmp/m1-dummy/config.json", "w"), indent=1)
if not os.path.exists("/tmp/m1-dummy-draft/config.json"):
    make_random_draft("kimi-k2.5-eagle3", "/tmp/m1-dummy-draft", target="/tmp/m1-dummy", dtype="bfloat16")
PY
serve_and_bench() {  # $1: label; the rest: extra serve flags
  label=$1; shift
  el "starting the server ($label)"
  setsid python3 -m mlaserve serve /tmp/m1-dummy --load-format dummy --port $PORT --deterministic-inference \
    --max-model-len $(( IN + OUTLEN + 64 )) --no-prefix-caching "$@" > "$OUT/server-$label.log" 2>&1 &
  SERVER=$!
  for i in $(seq 1 600); do
    curl -sf http://127.0.0.1:$PORT/health >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { el "server died"; tail -40 "$OUT/server-$label.log"; return 1; }
    sleep 1
  done
  el "server up"; grep -E "deterministic|warm-up" "$OUT/server-$label.log" | cut -c1-200
  timeout ${BENCH_S:-400} python3 -m mlaserve bench serve --base-url http://127.0.0.1:$PORT --num-prompts 8 \
    --max-concurrency 8 --input-len $IN --output-len $OUTLEN --seed 20260724 --num-warmups 0 --temperature 0 \
    --ignore-eos --disable-tqdm --label "m1-det-$label" --save-result "$OUT/det-$label.json" 2>&1 \
    | grep -E "Successful|Failed|Median (TTFT|TPOT)|Output token throughput|Acceptance"
  kill -INT $SERVER; sleep 4; kill -9 -$SERVER 2>/dev/null
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
