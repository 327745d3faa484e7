"""bench_engine with the decode (BLOCK_M 16) fused-MoE tiles overridden, for A/B runs of tile choices in the whole
engine without editing moe_config.py:
    AB_MOE='{"tma": true, "gemm1": {"num_stages": 2}, "gemm2": {"num_stages": 3}}' \
        PYTHONPATH=$PWD python benchmarks/ab_moe.py --model /tmp/m1 --batches 1,32 --contexts 512 --ttft 512
"tma" sets MLASERVE_MOE_TMA; "gemm1" / "gemm2" update moe_config's decode tiles (calls with their own config, such
as tests and kernels_bench, are left alone). Everything after the script name goes to bench_engine."""

import json
import os
import runpy
import sys

import mlaserve.kernels.fused_moe as fused_moe


def main():
    ov = json.loads(os.environ.get("AB_MOE", "{}"))
    base = fused_moe.moe_config

    def patched(T, K, E, D, I, dtype, tma=False, **o):
        c1, c2 = base(T, K, E, D, I, dtype, tma=tma, **o)
        if c1["BLOCK_M"] == 16 and not o:
            c1, c2 = {**c1, **ov.get("gemm1", {})}, {**c2, **ov.get("gemm2", {})}
        return c1, c2

    fused_moe.moe_config = patched
    if "tma" in ov:
        os.environ["MLASERVE_MOE_TMA"] = "1" if ov["tma"] else "0"
    sys.argv = [os.path.join(os.path.dirname(__file__), "bench_engine.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
