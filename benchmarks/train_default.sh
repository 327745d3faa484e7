#!/usr/bin/env bash
# The default model's recipe (mlaserve train-model) on one GPU, in one call of at most 10 minutes; everything the
# lead needs lands in $OUT (at most 8 files of at most 16 MiB: the model folder travels as a split tar).
#   bash benchmarks/train_default.sh          full: corpus, tokenizer, tokens, training (TOKENS, stopped at
#                                             TIME_LIMIT minutes from the start), the model card
#   MODE=bench bash benchmarks/train_default.sh   the same data stages, then STEPS steps: prints tokens/s
#   MODE=draft bash benchmarks/train_default.sh   the EAGLE3 draft of MODEL (default: the shipped model) only
#   MODE=tests bash benchmarks/train_default.sh   the gpu tests of the training code (tests/gpu/test_train_gpu.py)
# WORK (default /tmp/mlaserve-train) keeps the corpus, tokenizer and checkpoint: on a machine that still holds it,
# running again resumes. Other flags for train-model: ARGS.
#   reassemble here: cat model.tar.part-* | tar xf -    (-> model/, corpus/manifest.json)
# Full mode then distills the EAGLE3 draft (mlaserve train-draft on windows of the corpus; DRAFT=0 skips it, its
# flags: DRAFT_ARGS) and leaves it as draft.tar (-> draft/).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OUT=${OUT:-out} TQDM_MININTERVAL=${TQDM_MININTERVAL:-20}
WORK=${WORK:-/tmp/mlaserve-train}
MODE=${MODE:-full}
mkdir -p "$OUT" "$WORK"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, transformers, tokenizers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'tokenizers', tokenizers.__version__, 'cpus', __import__('os').cpu_count())" | tee -a "$OUT/env.txt"

if [[ $MODE == tests ]]; then
  timeout 500 python3 -m pytest -q tests/gpu/test_train_gpu.py tests/train -x -p no:cacheprovider -o addopts="" -rfE \
    2>&1 | tee "$OUT/tests.log" | tail -30
  exit
fi

if [[ $MODE == draft ]]; then
  # the draft of a model already made (MODEL, default: the shipped one): its corpus rebuilt from its manifest and
  # tokenized by its own tokenizer, then the same train-draft as full mode
  MODEL=${MODEL:-mlaserve/assets/pycode-13m}
  mkdir -p "$WORK/tokenizer" && cp "$MODEL/tokenizer.json" "$MODEL/tokenizer_config.json" "$WORK/tokenizer/"
  python3 -m mlaserve --log-level INFO train-model "$WORK" --manifest "$MODEL/corpus_manifest.json" --stage tokens \
    2>&1 | tee "$OUT/data.log" | tail -5
  echo "[+$(( $(date +%s) - t0 ))s] train-draft"
  timeout $(( 595 - ($(date +%s) - t0) )) python3 -m mlaserve --log-level WARNING train-draft "$MODEL" \
    "$WORK/draft" --corpus "$WORK/corpus" --no-embedding --disable-tqdm ${DRAFT_ARGS:---num-prompts 4096 --max-len 256 \
    --steps 3000 --batch 32 --eval-prompts 32} 2>&1 | tee "$OUT/draft.log" | tail -8
  rc=$?
  echo "[+$(( $(date +%s) - t0 ))s] train-draft exit $rc"
  [[ -d $WORK/draft ]] && tar cf "$OUT/draft.tar" -C "$WORK" draft
  exit $rc
fi

common=(--tokens "${TOKENS:-500e6}" ${ARGS})
if [[ $MODE == bench ]]; then
  timeout 560 python3 -m mlaserve --log-level INFO train-model "$WORK" "${common[@]}" --stop-at-step "${STEPS:-60}" \
    --card-samples 0 --time-limit "${TIME_LIMIT:-8.5}" 2>&1 | tee "$OUT/train.log" | tail -40
else
  timeout 590 python3 -m mlaserve --log-level INFO train-model "$WORK" "${common[@]}" --time-limit "${TIME_LIMIT:-8}" \
    2>&1 | tee "$OUT/train.log" | tail -60
fi
rc=$?
echo "[+$(( $(date +%s) - t0 ))s] train-model exit $rc; token files:"
ls -la "$WORK/corpus" | tee -a "$OUT/env.txt"
cat "$WORK/corpus/tokens.json" 2>/dev/null
python3 - "$WORK" <<'PY'
import json, os, statistics, sys
p = os.path.join(sys.argv[1], "model", "train_model.json")
if os.path.isfile(p):
    f = json.load(open(p))
    r = [h["tokens_per_s"] for h in f["history"] if "tokens_per_s" in h]
    print(f"params {f['params']:,}  steps {f['step']}/{f['steps']}  tokens/s median {statistics.median(r[1:] or r):,.0f}"
          f"  max {max(r):,.0f}  held-out loss {f['held_out_loss']:.4f}  bpb {f['bpb']:.4f}  train {f['train_seconds']:.0f} s")
PY
if [[ -d $WORK/model ]]; then
  cp "$WORK/model/README.md" "$WORK/model/loss.png" "$OUT/" 2>/dev/null
  tar cf - -C "$WORK" model corpus/manifest.json corpus/tokens.json | split -b 15m - "$OUT/model.tar.part-"
  ls -la "$OUT"
fi
if [[ $MODE == full && ${DRAFT:-1} != 0 && -f $WORK/model/model.safetensors ]]; then
  echo "[+$(( $(date +%s) - t0 ))s] train-draft"
  timeout $(( 595 - ($(date +%s) - t0) )) python3 -m mlaserve --log-level WARNING train-draft "$WORK/model" \
    "$WORK/draft" --corpus "$WORK/corpus" --no-embedding --disable-tqdm ${DRAFT_ARGS:---num-prompts 4096 --max-len 256 \
    --steps 3000 \
    --batch 32 --eval-prompts 32} 2>&1 | tee "$OUT/draft.log" | tail -8
  rc=$?
  echo "[+$(( $(date +%s) - t0 ))s] train-draft exit $rc"
  [[ -d $WORK/draft ]] && tar cf "$OUT/draft.tar" -C "$WORK" draft
fi
