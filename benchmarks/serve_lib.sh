# Sourced by the serving-protocol scripts (first_run_ttft.sh, deterministic_serve.sh, spec_agreement.sh, m3_tp4.sh):
# the environment, the wheels, a server's start and stop, and one run of the protocol (docs/benchmarking.md: 8
# prompts, concurrency 8, seed 20260724, greedy, no client warm-ups, IN input and OUTLEN output tokens).
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
IN=${IN:-8192}; OUTLEN=${OUTLEN:-8192}; PORT=${PORT:-8000}
mkdir -p "$OUT"
source benchmarks/wheels.sh
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }

# M1's config at /tmp/m1-dummy (served with --load-format dummy: random weights in place), and with an argument a
# random EAGLE3 draft for it at /tmp/m1-dummy-draft
m1_dummy() {
  DRAFT=${1:-} python3 - <<'PY'
import json, os
from mlaserve.models.make_random import load_preset
from mlaserve.models.make_random_draft import make_random_draft
raw = load_preset("moonlight-16b-a3b"); raw.pop("_note", None)
os.makedirs("/tmp/m1-dummy", exist_ok=True); json.dump(raw, open("/tmp/m1-dummy/config.json", "w"), indent=1)
if os.environ["DRAFT"] and not os.path.exists("/tmp/m1-dummy-draft/config.json"):
    make_random_draft("kimi-k2.5-eagle3", "/tmp/m1-dummy-draft", target="/tmp/m1-dummy", dtype="bfloat16")
PY
}

# start_server LABEL MODEL [serve flags...]: in its own process group, log in $OUT/server-LABEL.log; returns once
# /health answers, or 1 if the server died (its log's tail printed)
start_server() {
  local label=$1 model=$2; shift 2
  el "starting the server ($label)"
  setsid python3 -m mlaserve serve "$model" --port $PORT "$@" > "$OUT/server-$label.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 ${SERVER_WAIT_S:-900}); do
    curl -sf http://127.0.0.1:$PORT/health >/dev/null && { el "server up"; return 0; }
    kill -0 $SERVER 2>/dev/null || { el "server died"; tail -40 "$OUT/server-$label.log"; return 1; }
    sleep 1
  done
  el "server not up after ${SERVER_WAIT_S:-900} s"; return 1
}

stop_server() { kill -INT $SERVER; sleep 4; kill -9 -$SERVER 2>/dev/null; }

# bench_protocol LABEL FILE [bench flags...]: one run of the protocol against the server, its result in FILE
bench_protocol() {
  local label=$1 file=$2; shift 2
  timeout ${BENCH_S:-600} python3 -m mlaserve bench serve --base-url http://127.0.0.1:$PORT --num-prompts 8 \
    --max-concurrency 8 --input-len $IN --output-len $OUTLEN --seed 20260724 --num-warmups 0 --temperature 0 \
    --ignore-eos --disable-tqdm --label "$label" --save-result "$file" "$@" 2>&1 \
    | grep -E "Successful|Failed|Median (TTFT|TPOT|E2EL)|Output token throughput|Acceptance|agree"
}
