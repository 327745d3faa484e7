#!/usr/bin/env bash
# A/B of source trees (branches, commits) and of environment switches, rounds interleaved so that drift in the
# GPU's clock and temperature hits every variant alike. Each variant runs its own tree's benchmarks/bench_engine.py
# on the M1 checkpoint /tmp/m1 (made by the first run if absent).
#
#   bash benchmarks/ab_trees.sh export main my-branch                # ab/main/, ab/my-branch/ by git archive
#   bash benchmarks/ab_trees.sh export nopdl=main:MLASERVE_PDL=0     # ab/nopdl/: main's tree run with that variable
#   bash benchmarks/ab_trees.sh run 2 --batches 1,8 --contexts 512 --ttft 512    # 2 rounds of every ab/*/ tree
#
# A variant is [NAME=]REF[:VAR=VALUE,...]. `run` passes its arguments after the round count to bench_engine and
# writes its JSON under $OUT (default out/) as engine_ab-<name>-r<round>_*.json; ab/ is git-ignored. Export here
# and run on the GPU machine with ab/ carried (a copied tree's git metadata can be stale, so export where it is not;
# bench_engine's JSON records the tree's AB_SOURCE line as ab_source).
# The trees leave out mlaserve/assets (the default model; the A/B runs M1). AB_MODEL replaces the model arguments
# (default "--model /tmp/m1 --make moonlight-16b-a3b"; "--preset moonlight-16b-a3b --dummy" makes no files).
set -eo pipefail
cmd=${1:?usage: ab_trees.sh export VARIANT... | run ROUNDS [bench_engine args]}
shift
case $cmd in
export)
  for v in "$@"; do
    spec=${v%%:*}
    envs=""; [[ $v == *:* ]] && envs=${v#*:}
    ref=${spec#*=}
    name=${spec%%=*}; name=${name//\//_}
    d=ab/$name
    rm -rf "$d" && mkdir -p "$d"
    git archive "$ref" -- . ':!benchmarks/results' ':!mlaserve/assets' | tar -x -C "$d"  # ~3 MB a tree
    [[ -n $envs ]] && echo "$envs" > "$d/AB_ENV"
    echo "$d <- $ref $(git rev-parse --short "$ref") ${envs}" | tee "$d/AB_SOURCE"
  done ;;
run)
  rounds=${1:?rounds}
  AB_MODEL=${AB_MODEL:---model /tmp/m1 --make moonlight-16b-a3b}
  shift
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OUT=${OUT:-out}
  OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
  for r in $(seq "$rounds"); do
    for d in ab/*/; do
      n=$(basename "$d")
      envs=(); [[ -f $d/AB_ENV ]] && IFS=, read -ra envs < "$d/AB_ENV"
      (cd "$d" && env "${envs[@]}" PYTHONPATH="$PWD" timeout 300 python3 benchmarks/bench_engine.py ${AB_MODEL} \
        --label "ab-$n-r$r" --out "$OUT" "$@" 2>&1 \
        | grep -E "^TPOT|^TTFT|Error" | sed "s/^/$n r$r  /") || echo "$n r$r: failed"
    done
  done ;;
*) echo "unknown command $cmd" >&2; exit 2 ;;
esac
