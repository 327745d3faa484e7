#!/usr/bin/env bash
# M3, the serving protocol on several GPUs (docs/benchmarking.md): Kimi-K2.5 shapes truncated to LAYERS layers,
# attn-tp = moe-tp = TP, random weights in place; an EAGLE3 K=1 N=2 server with a random draft, run RUNS times
# (default 2), then a plain server once; 8 prompts, concurrency 8, seed 20260724, greedy, no warm-ups, IN input and
# OUTLEN output tokens (default 8192 / 1024); `bench compare` of the runs at the end. Results under $OUT.
#   bash benchmarks/m3_tp4.sh                       # 4 GPUs: TP=4 LAYERS=12
#   TP=2 LAYERS=6 bash benchmarks/m3_tp4.sh         # 2 GPUs
#   NCCL_TEST=1 ...                                 # the NCCL parity test first
# Needs mlaserve installed with its server dependencies (pip install -e .), or their wheels in .whl/.
# Optional stages first: ALLREDUCE_BENCH=1 (one-shot / two-shot / NCCL at 1-64 rows of 7168,
# benchmarks/allreduce_bench.py), LAYER_BENCH=1 (per-layer decode time at TP=$TP against one GPU).
OUTLEN=${OUTLEN:-1024}; TP=${TP:-4}; LAYERS=${LAYERS:-12}
source benchmarks/serve_lib.sh
nvidia-smi -L
if [[ -n "$NCCL_TEST" ]]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/tp/test_tp_parity.py -k nccl 2>&1 | tail -3
fi
if [[ -n "$ALLREDUCE_BENCH" ]]; then
  el "all-reduce bench (world $TP)"
  timeout ${ALLREDUCE_S:-200} python3 benchmarks/allreduce_bench.py --worlds $TP 2>&1 | tail -16
fi
if [[ -n "$LAYER_BENCH" ]]; then
  el "per-layer decode time, one GPU then TP=$TP"
  timeout ${LAYER_S:-400} python3 benchmarks/tp_layer_bench.py --preset kimi-k2.5 --layers ${LAYER_BENCH_LAYERS:-4} \
    --tp 1,$TP --batches 1,8 2>&1 | grep -vE "Loading|it/s" | tail -12
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
serve_and_bench() {  # $1: label; the rest: extra serve flags
  local label=$1; shift
  start_server $label /tmp/m3 --tp $TP --load-format dummy --max-num-seqs 16 --max-model-len $(( IN + OUTLEN + 64 )) \
    --no-prefix-caching "$@" || return 1
  grep -E "captured|loaded|KV cache|EAGLE3" "$OUT/server-$label.log" | cut -c1-240
  for run in $(seq 1 ${RUNS:-2}); do
    el "bench run $run"
    BENCH_S=${BENCH_S:-200} bench_protocol "kimi-${LAYERS}l-tp${TP}-$label-run$run" "$OUT/$label-run$run.json"
  done
  stop_server
}
serve_and_bench eagle3 --speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/m3-draft \
  --speculative-num-steps 1 --speculative-num-draft-tokens 2
RUNS=1 serve_and_bench plain
python3 -m mlaserve bench compare --baseline "$OUT/eagle3-run1.json" --candidate "$OUT/eagle3-run2.json" 2>&1 | tail -8
python3 -m mlaserve bench compare --baseline "$OUT/plain-run1.json" --candidate "$OUT/eagle3-run1.json" "$OUT/eagle3-run2.json" 2>&1 | tail -14
el "done"
