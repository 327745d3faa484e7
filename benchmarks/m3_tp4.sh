#!/usr/bin/env bash
# M3 on 4 GPUs (TP=4 LAYERS=12; or TP=2 LAYERS=6 on two): Kimi-K2.5 shapes, attn-tp = moe-tp, random weights in place, EAGLE3 K=1 N=2 with a
# random draft; serves the seed protocol (8 prompts, concurrency 8, seed 20260724, greedy, 0 warmups) twice with
# a shortened output, then compares the runs. Needs the server's wheels carried in .whl (see the device README).
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false
IN=${IN:-8192}; OUTLEN=${OUTLEN:-1024}; PORT=8000; TP=${TP:-4}; LAYERS=${LAYERS:-12}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi -L
if [[ -n "$NCCL_TEST" ]]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/tp/test_tp_parity.py -k nccl 2>&1 | tail -3
fi
LAYERS=$LAYERS python3 - <<'PY'
import json, os
from mlaserve.models.make_random import load_preset
from mlaserve.models.make_random_draft import make_random_draft
raw = load_preset("kimi-k2.5"); raw.pop("_note", None); raw["text_config"]["num_hidden_layers"] = int(os.environ["LAYERS"])
os.makedirs("/tmp/m3", exist_ok=True); json.dump(raw, open("/tmp/m3/config.json", "w"), indent=1)
make_random_draft("kimi-k2.5-eagle3", "/tmp/m3-draft", target="/tmp/m3", dtype="bfloat16", device="cuda")
print("wrote /tmp/m3 (config only: dummy weights) and /tmp/m3-draft")
PY
el "starting the server"
setsid python3 -m mlaserve serve /tmp/m3 --tp $TP --load-format dummy --port $PORT --max-num-seqs 16 \
  --max-model-len $(( IN + OUTLEN + 64 )) --speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/m3-draft \
  --speculative-num-steps 1 --speculative-num-draft-tokens 2 > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 300); do
  curl -sf http://127.0.0.1:$PORT/health >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { el "server died"; tail -40 "$OUT/server.log"; exit 1; }
  sleep 1
done
el "server up"; grep -E "captured|loaded|KV cache|EAGLE3" "$OUT/server.log" | cut -c1-240
for run in 1 2; do
  el "bench run $run"
  timeout ${BENCH_S:-200} python3 -m mlaserve bench serve --base-url http://127.0.0.1:$PORT --num-prompts 8 \
    --max-concurrency 8 --input-len $IN --output-len $OUTLEN --seed 20260724 --num-warmups 0 --temperature 0 \
    --ignore-eos --disable-tqdm --label "kimi-${LAYERS}l-tp${TP}-eagle3-run$run" --save-result "$OUT/m3-run$run.json" 2>&1 | tail -28
done
python3 -m mlaserve bench compare --baseline "$OUT/m3-run1.json" --candidate "$OUT/m3-run2.json" 2>&1 | tail -20
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^mlaserve:(spec|generation|prompt)" > "$OUT/metrics.txt"
kill -INT $SERVER; sleep 5; kill -9 -$SERVER 2>/dev/null
tail -5 "$OUT/server.log"
el "done"
