#!/usr/bin/env bash
# One device call: environment, gpu tests, kernel bench, whole-model bench. Each stage has its own time limit so
# the call ends inside the device tool's 10 minutes; everything is logged under $OUT.
#   bash benchmarks/gpu_run.sh [tests] [kernels] [m1] [spec] [m2] [tp] [ncu]
# Env: TESTS / TESTS_K / TESTS_S, KERNEL_ARGS / KERNELS_S, M1_ARGS / M1_S, SPEC_S / SPEC_ARGS (e.g. --profile) / SPEC_TAIL, M2_S, TP_S / TP_ARGS, PROBE_S / PROBE_ARGS / NCU_S (see each stage).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
stages=" $* "
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
if [[ $stages == *" tests "* ]]; then
  el "gpu tests"
  # TESTS: paths (word-split); TESTS_K: a -k expression (kept whole, e.g. TESTS_K="router or align")
  timeout ${TESTS_S:-170} python3 -m pytest -q ${TESTS:-tests/gpu} ${TESTS_K:+-k "$TESTS_K"} -p no:cacheprovider -o addopts="" -rfE --timeout 90 \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -25
fi
if [[ $stages == *" kernels "* ]]; then
  el "kernels bench"
  timeout ${KERNELS_S:-140} python3 benchmarks/kernels_bench.py ${KERNEL_ARGS:---quick} --time-limit $(( ${KERNELS_S:-140} - 10 )) \
    2>&1 | tee "$OUT/kernels.log" | tail -45
fi
if [[ $stages == *" m1 "* ]]; then
  el "M1 engine bench (+ transformers)"
  timeout ${M1_S:-300} python3 benchmarks/bench_engine.py --model /tmp/m1 --make moonlight-16b-a3b ${M1_ARGS:---hf --hf-last --profile} \
    --label m1 2>&1 | tee "$OUT/m1.log" | grep -v "it/s\]" | tail -48
fi
if [[ $stages == *" spec "* ]]; then
  el "M1 EAGLE3 bench"
  timeout ${SPEC_S:-200} python3 benchmarks/bench_engine.py --model /tmp/m1 --make moonlight-16b-a3b \
    --draft /tmp/m1-draft --spec-only --batches 1,8 ${SPEC_ARGS} --label m1-eagle3 2>&1 | tee "$OUT/spec.log" \
    | grep -vE "it/s" | tail -${SPEC_TAIL:-12}
fi
if [[ $stages == *" m2 "* ]]; then
  el "M2 engine bench (dummy weights)"
  timeout ${M2_S:-200} python3 benchmarks/bench_engine.py --preset kimi-k2.5 --layers 4 --dummy --label m2 --gpu-mem 0.95 \
    --batches 1,8 --contexts 512 --ttft 512,8192 2>&1 | tee "$OUT/m2.log" | tail -12
fi
if [[ $stages == *" tp "* ]]; then  # on nvidia-h200-x2: TP2 under CUDA graphs, PDL on (default) then off
  el "TP2 under graphs"
  timeout ${TP_S:-120} python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/tp/test_tp_parity.py -k nccl 2>&1 | tail -2
  for pdl in 1 0; do
    el "tp_graph_check MLASERVE_PDL=$pdl"
    MLASERVE_PDL=$pdl OUT=$OUT/tp-pdl-$pdl timeout ${TP_S:-120} python3 benchmarks/tp_graph_check.py ${TP_ARGS:---quick} 2>&1 \
      | grep -vE "Loading|it/s" | tail -8
  done
fi
if [[ $stages == *" ncu "* ]]; then  # why the batch-1 MoE GEMMs stream at ~70 %: Nsight Compute's counters
  el "MoE T=1 probe (graphs, 26 layers' weights) + ncu"
  timeout ${PROBE_S:-200} python3 benchmarks/moe_ncu_probe.py --sweep --layers 26 --reps 30 ${PROBE_ARGS} 2>&1 \
    | tee "$OUT/moe_probe.log" | grep -vE "Warning|warn" | tail -16
  # NCU_KERNELS / NCU_PROBE_ARGS, e.g. NCU_KERNELS="regex:_moe_gemm1|nvjet" NCU_PROBE_ARGS="--stages 3,3 --lm-head"
  timeout ${NCU_S:-150} ncu --kernel-name ${NCU_KERNELS:-regex:_moe_gemm} --launch-skip ${NCU_SKIP:-16} \
    --launch-count ${NCU_COUNT:-4} --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis_Chart \
    python3 benchmarks/moe_ncu_probe.py --reps 3 ${NCU_PROBE_ARGS} > "$OUT/ncu_moe.txt" 2>&1
  grep -E "_moe_gemm|DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Stall|Warp Cycles" \
    "$OUT/ncu_moe.txt" | head -40
fi
find benchmarks/results -maxdepth 1 -name "*.json" -newer "$OUT/env.txt" -exec cp {} "$OUT/" \; 2>/dev/null
el "done"
