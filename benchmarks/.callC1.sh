export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TOKENIZERS_PARALLELISM=false
mkdir -p $OUT; date > $OUT/env.txt
timeout 250 python3 -m pytest -q -p no:cacheprovider -o addopts="" --tb=short -rfE --timeout 100 tests/gpu \
  tests/kernels_interp/test_moe_interp.py tests/kernels_interp/test_rmsnorm_interp.py tests/kernels_interp/test_silu_mul_interp.py \
  tests/kernels_interp/test_triton_backend_interp.py tests/kernels_interp/test_prefill_interp.py \
  tests/kernels_interp/test_mla_decode_interp.py > $OUT/t.log 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/t.log | tail -15
grep -E "^E  " $OUT/t.log | head -10
timeout 250 python3 benchmarks/kernels_bench.py --only mla,moe,moe_sweep,prefill --time-limit 240 > $OUT/kernels.log 2>&1
grep -E "moe_sweep|fused_moe|^prefill|mla_decode.*(B=16|B=32).*ctx=8192|mla_decode.*B=1 " $OUT/kernels.log | grep -v "Warn\|H=64" | head -80
tail -2 $OUT/kernels.log
