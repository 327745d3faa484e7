#!/usr/bin/env bash
# A/B of whole source trees (branches) in one device call, rounds interleaved so drift hits every tree alike.
#   here:   bash benchmarks/ab_trees.sh export main s8-mla-prewait-kv     # ab/<branch>/ from git archive (ignored)
#   device: run with carry ["ab"]:
#           bash benchmarks/ab_trees.sh run 2 --batches 1,8,32 --contexts 512 --ttft 512     # 2 rounds of each tree
# Each tree runs its own benchmarks/bench_engine.py on the M1 checkpoint /tmp/m1 (made once by the first tree);
# JSON under $OUT as engine_ab-<tree>-r<round>_*.json.
set -eo pipefail
cmd=${1:?export BRANCH... | run ROUNDS [bench_engine args]}
shift
case $cmd in
export)
  for b in "$@"; do
    d=ab/${b//\//_}
    rm -rf "$d" && mkdir -p "$d"
    git archive "$b" -- . ':!benchmarks/results' | tar -x -C "$d"
    echo "$d <- $b $(git rev-parse --short "$b")" | tee "$d/AB_SOURCE"
  done ;;
run)
  rounds=${1:?rounds}
  shift
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OUT=${OUT:-out}
  mkdir -p "$OUT"
  for r in $(seq "$rounds"); do
    for d in ab/*/; do
      n=$(basename "$d")
      (cd "$d" && PYTHONPATH=$PWD timeout 150 python3 benchmarks/bench_engine.py --model /tmp/m1 \
        --make moonlight-16b-a3b --label "ab-$n-r$r" --out "$OUT" "$@" 2>&1 \
        | grep -E "^TPOT|^TTFT|Error" | sed "s/^/$n r$r  /") || echo "$n r$r: failed"
    done
  done ;;
*) echo "unknown command $cmd" >&2; exit 2 ;;
esac
