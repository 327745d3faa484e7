"""Shared by the kernel gpu tests: skip under the interpreter, and fresh inputs each run with the seed printed."""

import os
import random

import pytest
import torch


@pytest.fixture
def gpu_seed(request):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: run the gpu tests in their own pytest process")
    seed = random.randrange(1 << 30)  # fresh inputs each run; the seed is printed on failure
    torch.manual_seed(seed)
    print(f"\n[{request.node.name}] device={torch.cuda.get_device_name()} seed={seed}")


@pytest.fixture(autouse=True)
def _no_startup_warmup(request, monkeypatch):
    """Engines built by the GPU tests skip the start-up warm-up (engine/warmup.py: ~1,200 eager steps at the default
    max_num_seqs), except in test_no_jit_gpu.py, which tests it: the warm-up compiles kernels, it changes no result."""
    if request.module.__name__.rsplit(".", 1)[-1] != "test_no_jit_gpu":
        monkeypatch.setattr("mlaserve.engine.engine.warm_up", lambda engine, steps=None: None)
