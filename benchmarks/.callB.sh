export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TOKENIZERS_PARALLELISM=false
mkdir -p $OUT; date > $OUT/env.txt
timeout 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" --tb=short -rfE --timeout 120 \
  "tests/gpu/test_kernels_gpu.py::test_model_triton_backend_matches_torch_ref" tests/kernels_interp/test_rmsnorm_interp.py \
  tests/kernels_interp/test_silu_mul_interp.py tests/kernels_interp/test_triton_backend_interp.py \
  tests/kernels_interp/test_rope_kv_interp.py tests/kernels_interp/test_prefill_interp.py > $OUT/t.log 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/t.log | tail -15
grep -E "^E  " $OUT/t.log | head -12
timeout 130 python3 benchmarks/kernels_bench.py --only mla_sweep,moe,routing --time-limit 120 > $OUT/kernels.log 2>&1
grep -E "mla_sweep|fused_moe|moe_align|router|routing" $OUT/kernels.log | grep -v Warn | head -90
timeout 280 python3 benchmarks/bench_engine.py --model /tmp/m1 --make moonlight-16b-a3b --profile --batches 1,8,32 --contexts 512 --label m1 > $OUT/m1.log 2>&1
grep -v "it/s\]" $OUT/m1.log | tail -25
find benchmarks/results -maxdepth 1 -name "*.json" -newer "$OUT/env.txt" -exec cp {} "$OUT/" \;
