"""The CPU's bf16 matmul caches are bounded (engine/cpu_matmul_caches.py): a CPU engine sets their capacities, an
environment's own values win, and with the bound a stream of new matmul shapes no longer grows the heap."""

import json
import os
import subprocess
import sys

import pytest
import torch

from mlaserve.engine.cpu_matmul_caches import CACHE_VARIABLES, MATMUL_CACHE_ENTRIES, bound_matmul_caches

from .conftest import make_engine

# A fresh interpreter (both capacities are read at the first bf16 matmul): 1,200 shapes, as a server's steps make
# them, then the growth of the heap in use (glibc's mallinfo2), in MB.
HEAP_GROWTH = """
import ctypes, json, sys, torch, torch.nn.functional as F
from mlaserve.engine.cpu_matmul_caches import bound_matmul_caches
torch.set_num_threads(1)
bound_matmul_caches(int(sys.argv[1]))
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keep")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def in_use():
    m = libc.mallinfo2()
    return (m.uordblks + m.hblkhd) / 2**20
ws = [torch.randn(n, k, dtype=torch.bfloat16) for n, k in ((128, 256), (256, 64))]
F.linear(torch.randn(1, 256, dtype=torch.bfloat16), ws[0])
start = in_use()
for m in range(1, 601):
    for w in ws:
        F.linear(torch.randn(m, w.shape[1], dtype=torch.bfloat16), w)
print(json.dumps(in_use() - start))
"""


def _heap_growth_mb(entries: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", HEAP_GROWTH, str(entries)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_environment_wins(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert bound_matmul_caches() == {"LRU_CACHE_CAPACITY": "7", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}


def test_cpu_engine_bounds_them(monkeypatch, tiny_ckpt):
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    make_engine(tiny_ckpt, num_pages=16, page_size=16)
    assert {name: os.environ[name] for name in CACHE_VARIABLES} == dict.fromkeys(
        CACHE_VARIABLES, str(MATMUL_CACHE_ENTRIES)
    )


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not torch.backends.mkldnn.is_available(), reason="glibc and oneDNN"
)
def test_new_shapes_do_not_grow_the_heap():
    unbounded = _heap_growth_mb(1024)  # the libraries' default
    if unbounded < 100:
        pytest.skip(f"this torch build keeps no per-shape bf16 matmul caches ({unbounded:.0f} MB for 1,200 shapes)")
    bounded = _heap_growth_mb(16)
    assert bounded < 64, f"the heap grew {bounded:.0f} MB over 1,200 matmul shapes with 16-entry caches"
