#!/usr/bin/env bash
# A/B of environment switches on one source tree in one device call, rounds interleaved so drift hits every
# variant alike (ab_trees.sh does the same for whole trees).
#   bash benchmarks/ab_env.sh ROUNDS "name:VAR=1,VAR2=0" "name2:VAR=0" ... -- [bench_engine args]
# Each variant runs benchmarks/bench_engine.py on the M1 checkpoint /tmp/m1 (made by the first run if absent)
# with its variables set; JSON under $OUT as engine_ab-<name>-r<round>_*.json.
set -eo pipefail
rounds=${1:?rounds}
shift
variants=()
while [[ $# -gt 0 && $1 != "--" ]]; do variants+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD OUT=${OUT:-out}
mkdir -p "$OUT"
for r in $(seq "$rounds"); do
  for v in "${variants[@]}"; do
    name=${v%%:*}
    envs=${v#*:}
    (IFS=, read -ra kv <<< "$envs"; env "${kv[@]}" timeout 150 python3 benchmarks/bench_engine.py --model /tmp/m1 \
      --make moonlight-16b-a3b --label "ab-$name-r$r" --out "$OUT" "$@" 2>&1 \
      | grep -E "^TPOT|^TTFT|Error" | sed "s/^/$name r$r  /") || echo "$name r$r: failed"
  done
done
