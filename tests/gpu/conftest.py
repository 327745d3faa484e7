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
