#!/usr/bin/env bash
# Nsight Compute on single launches of the MoE's kernels at chosen step sizes: speed of light, memory workload,
# warp stall reasons (with the source lines that stall), occupancy, launch and scheduler statistics. One report a
# case under $OUT (default out/), and a digest of the key lines printed at the end.
#
#   bash benchmarks/moe_ncu.sh                       # the default cases below
#   CASES="int4:1:512:gemv1 bf16:2048:1408:gemm1" bash benchmarks/moe_ncu.sh
#
# A case is FORM:T:I:KERNEL: FORM int4 (Kimi-K2.5's experts, 7168 -> I, 8 of 384; int4_moe_call.py) or bf16 (M1's
# experts, 2048 -> I, 6 of 64; moe_call.py), T tokens, KERNEL a regular expression on the kernel's name; the third
# launch of that kernel in the script is profiled (the first two compile and warm). --clock-control none keeps the
# GPU's own clocks, as the timings elsewhere run. Needs a GPU and ncu (on PATH, or NCU=...).
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-$PWD} OUT=${OUT:-out}
mkdir -p "$OUT"
NCU=${NCU:-ncu}
CASES=${CASES:-"int4:1:512:gemv1 int4:1:512:gemv2 int4:512:2048:gemm1 int4:512:2048:gemm2 int4:1:2048:gemv1"}
SECTIONS=(SpeedOfLight MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Tables WarpStateStats SourceCounters Occupancy
  LaunchStats SchedulerStats ComputeWorkloadAnalysis)
args=(--clock-control none --launch-skip 2 --launch-count 1 --print-details all)
for s in "${SECTIONS[@]}"; do args+=(--section "$s"); done
for c in $CASES; do
  IFS=: read -r form T I kernel <<< "$c"
  name="ncu_${form}_T${T}_I${I}_${kernel//[^A-Za-z0-9_]/_}"
  if [[ $form == int4 ]]; then
    env=(INT4_CALL_T="$T" INT4_CALL_I="$I"); script=benchmarks/int4_moe_call.py
  else
    env=(MOE_CALL_T="$T" MOE_CALL_SHAPE="2048,$I,64,6"); script=benchmarks/moe_call.py
  fi
  env "${env[@]}" timeout "${CASE_TIMEOUT:-120}" "$NCU" "${args[@]}" --kernel-name "regex:$kernel" \
    python "$script" > "$OUT/$name.txt" 2>&1
  echo "$name: rc $?"
done
grep -H -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Memory Throughput|L1/TEX Cache Throughput|L2 Hit Rate|Achieved \
Occupancy|Registers Per Thread|Theoretical Occupancy|Warp Cycles Per Issued|Issued Warp|No Eligible|Stall|bytes \
transmitted per sector|bank conflict|partial wave" "$OUT"/ncu_*.txt | head -400
