#!/usr/bin/env bash
# The GPU suite and the benchmarks in one go, each stage under its own time limit, everything logged under $OUT.
#   bash benchmarks/gpu_run.sh [tests] [kernels] [m1] [spec] [m2] [tp] [ngram] ...
#     tests    the gpu-marked tests (TESTS: paths, TESTS_K: a -k expression, TESTS_S: seconds)
#     kernels  benchmarks/kernels_bench.py (KERNEL_ARGS, default --quick; KERNELS_S)
#     m1       benchmarks/bench_engine.py on M1 (made at /tmp/m1 if absent), transformers after it (M1_ARGS; M1_S)
#     spec     the same with an EAGLE3 draft at /tmp/m1-draft, K=1 N=2 (SPEC_ARGS, e.g. --profile; SPEC_S)
#     m2       M2: Kimi-K2.5 shapes, 4 layers, random weights in place (M2_S)
#     int4     Kimi-K2.5 shapes, 4 layers, INT4 experts, dummy weights (INT4_S)
#     fp8      DeepSeek-V3 shapes, 6 layers, FP8 blocks, dummy weights, then the same model in bf16 (FP8_S)
#     tp       two GPUs: the NCCL parity test and TP2 under CUDA graphs against one GPU (TP_S)
#     structured  benchmarks/structured_cost.py: structured output's cost per decode step on M1 shapes (STRUCT_S)
#     mtp      DeepSeek-V3 shapes, 6 layers, FP8, dummy weights, with the MTP layer: its K=1 step against plain, then
#              K=1, 2 at simulated acceptance 0, 0.7 and 1 (MTP_S)
#     ngram    benchmarks/ngram_speed.py on the default model, K=3 and K=1 (NGRAM_S each)
#     kvfp8    M1 TPOT at batch 8 and 32, context 8192, with the latent cache in the model's dtype then in FP8
#              (--kv-cache-dtype fp8), and the KV tokens each holds at the same --gpu-mem (KVFP8_S)
# Packages the machine lacks (xgrammar, apache-tvm-ffi, the server's) travel as wheels in .whl/, installed first.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
source benchmarks/wheels.sh
stages=" $* "
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
if [[ $stages == *" tests "* ]]; then
  el "gpu tests"
  timeout ${TESTS_S:-600} python3 -m pytest -q ${TESTS:-tests/gpu} ${TESTS_K:+-k "$TESTS_K"} -p no:cacheprovider -o addopts="" -rfE \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -25
fi
if [[ $stages == *" kernels "* ]]; then
  el "kernels bench"
  timeout ${KERNELS_S:-300} python3 benchmarks/kernels_bench.py ${KERNEL_ARGS:---quick} --time-limit $(( ${KERNELS_S:-300} - 10 )) \
    2>&1 | tee "$OUT/kernels.log" | tail -45
fi
if [[ $stages == *" m1 "* ]]; then
  el "M1 engine bench (+ transformers)"
  timeout ${M1_S:-600} python3 benchmarks/bench_engine.py --model /tmp/m1 --make moonlight-16b-a3b ${M1_ARGS:---hf --hf-last} \
    --label m1 2>&1 | tee "$OUT/m1.log" | grep -v "it/s\]" | tail -48
fi
if [[ $stages == *" spec "* ]]; then
  el "M1 EAGLE3 bench"
  timeout ${SPEC_S:-300} python3 benchmarks/bench_engine.py --model /tmp/m1 --make moonlight-16b-a3b \
    --draft /tmp/m1-draft --spec-only --batches 1,8 ${SPEC_ARGS} --label m1-eagle3 2>&1 | tee "$OUT/spec.log" \
    | grep -vE "it/s" | tail -12
fi
if [[ $stages == *" m2 "* ]]; then
  el "M2 engine bench (random weights in place)"
  timeout ${M2_S:-300} python3 benchmarks/bench_engine.py --preset kimi-k2.5 --layers 4 --dummy --label m2 --gpu-mem 0.95 \
    --batches 1,8 --contexts 512 --ttft 512,8192 2>&1 | tee "$OUT/m2.log" | tail -12
fi
if [[ $stages == *" int4 "* ]]; then
  el "Kimi-K2.5 INT4 experts engine bench"
  timeout ${INT4_S:-300} python3 benchmarks/bench_engine.py --preset kimi-k2.5 --layers 4 --dummy --quantization int4-experts \
    --label kimi-int4 --gpu-mem 0.95 --batches 1,8 --contexts 512 --ttft 512 2>&1 | tee "$OUT/int4.log" | tail -14
fi
if [[ $stages == *" fp8 "* ]]; then
  el "DeepSeek-V3 FP8 engine bench, then bf16 in the same run"
  timeout ${FP8_S:-400} python3 benchmarks/bench_engine.py --preset deepseek-v3 --layers 6 --dummy --quantization fp8-block \
    --compare-unquantized --label dsv3-fp8 --gpu-mem 0.95 --batches 1,8 --contexts 512 --ttft 8192 2>&1 \
    | tee "$OUT/fp8.log" | tail -20
fi
if [[ $stages == *" tp "* ]]; then  # needs two GPUs
  el "TP2: NCCL parity, then TP2 under CUDA graphs against one GPU (PDL on and off)"
  timeout ${TP_S:-300} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfE tests/tp/test_tp_parity.py \
    tests/gpu/test_tp_graphs_gpu.py -k "nccl or graphs" 2>&1 | tee "$OUT/tp.log" | tail -4
fi
if [[ $stages == *" structured "* ]]; then
  el "structured output: cost per decode step at batch 1 and 8, plain greedy beside it (M1 shapes, dummy weights)"
  timeout ${STRUCT_S:-300} python3 benchmarks/structured_cost.py --preset moonlight-16b-a3b --batches 1,8 --tokens 256 \
    --out "$OUT/structured_cost.json" 2>&1 | tee "$OUT/structured.log" | grep -vE "it/s|Loading" | tail -8
fi
if [[ $stages == *" mtp "* ]]; then
  el "DeepSeek-V3 FP8 with its MTP layer: the MTP step (K=1, N=2) against plain decode, same run"
  timeout ${MTP_S:-400} python3 benchmarks/bench_engine.py --preset deepseek-v3 --layers 6 --dummy --quantization fp8-block \
    --mtp --spec-only --label dsv3-fp8-mtp --gpu-mem 0.95 --batches 1,8 --contexts 512 --simulate-sweep --sweep-k 1,2 \
    --sweep-acceptance 0,0.7,1.0 2>&1 | tee "$OUT/mtp.log" | grep -vE "it/s" | tail -16
fi
if [[ $stages == *" ngram "* ]]; then
  el "NGRAM (prompt lookup) against plain decoding on the default model, K=3 then K=1 (NGRAM_S each)"
  for k in 3 1; do
    timeout ${NGRAM_S:-240} python3 benchmarks/ngram_speed.py --k $k --rounds 2 --out "$OUT" 2>&1 \
      | tee "$OUT/ngram_k$k.log" | grep -vE "it/s|Loading" | tail -12
  done
fi
if [[ $stages == *" kvfp8 "* ]]; then
  el "M1 TPOT at context 8192 with the KV cache in bf16, then in FP8 (same memory)"
  for kv in auto fp8; do
    timeout ${KVFP8_S:-300} python3 benchmarks/bench_engine.py --model /tmp/m1 --make moonlight-16b-a3b \
      --kv-cache-dtype $kv --batches 8,32 --contexts 8192 --ttft 8192 --label m1-kv$kv 2>&1 \
      | tee "$OUT/kv$kv.log" | grep -E "KV cache|TPOT|TTFT" | tail -5
  done
fi
find benchmarks/results -maxdepth 1 -name "*.json" -newer "$OUT/env.txt" -exec cp {} "$OUT/" \; 2>/dev/null
el "done"
