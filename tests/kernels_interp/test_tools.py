"""The two GPU-side scripts, exercised without a GPU: every kernel compiles for sm_90 (no spills, shared memory
within 227 KB), and kernels_bench.py runs every section end to end at toy sizes under the interpreter."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, env_update, timeout):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_update, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{args} exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p.stdout


@pytest.mark.slow
def test_compile_check_sm90():
    pytest.importorskip("triton")
    out = _run(["benchmarks/compile_check.py", "--quick"], {}, timeout=600)
    assert "compiled for sm_90" in out


@pytest.mark.slow
def test_kernels_bench_smoke(tmp_path):
    pytest.importorskip("triton")
    out = _run(["benchmarks/kernels_bench.py", "--smoke"], {"OUT": str(tmp_path)}, timeout=600)
    assert "0 accuracy failures" in out and (tmp_path / "kernels_bench.json").is_file()
