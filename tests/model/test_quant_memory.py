"""After load a quantized model holds about its quantized bytes, not the dequantized ones: parameter storage by
kind (models/weight_bytes.py), and the process's resident memory on a model large enough to measure."""

import os
import subprocess
import sys

import pytest
import torch

from mlaserve.models.weight_bytes import weight_bytes
from tests.helpers.quant_ckpt import make_quantized

from .helpers import load_model


@pytest.mark.parametrize("scheme", ["int4", "fp8"])
def test_parameter_bytes_by_kind(scheme, int4_ckpt, fp8_ckpt):
    model = load_model({"int4": int4_ckpt, "fp8": fp8_ckpt}[scheme])
    wb = weight_bytes(model)
    assert wb.total == sum(p.numel() * p.element_size() for p in model.parameters())
    if scheme == "int4":  # 4 bits a weight + a bf16 scale per 32: 0.5625 bytes; the model dtype is fp32 here
        E, D, I = 8, 64, 32
        assert wb.quantized == 2 * E * 3 * D * I * (0.5 + 2 / 32) and wb.dequantized == 2 * E * 3 * D * I * 4
        assert wb.expanded == 0
    else:
        assert (
            wb.dequantized == 4 * sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
            and wb.quantized < wb.dequantized / 3.9
        )
        kv_b = [layer.self_attn.kv_b_proj.weight for layer in model.model.layers]
        assert wb.expanded == sum(w.numel() * 4 for w in kv_b) and wb.expanded_what == "kv_b_proj x3"


RSS_PROBE = """
import gc, sys, torch
from tests.model.helpers import load_model
from mlaserve.models.weight_bytes import weight_bytes

def rss():
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

torch.ones(1)  # torch's own allocations before the baseline
before = rss()
model = load_model(sys.argv[1])
print(rss() - before, weight_bytes(model).total)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
@pytest.mark.parametrize("scheme", ["int4-experts", "fp8-block"])
def test_resident_memory_after_load_is_the_quantized_size(scheme, tmp_path):
    """2 MoE layers of 32 experts 512 x 512: 50 M expert weights, 201 MB dequantized in fp32; 28 MB as INT4, 50 MB as
    FP8. The process grows by about the quantized size (the old loader expanded everything at load)."""
    big = dict(hidden_size=512, moe_intermediate_size=512, n_routed_experts=32, q_lora_rank=64, kv_lora_rank=64)
    path = make_quantized(tmp_path / "m", scheme, **big)
    out = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, path],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.returncode == 0, out.stderr
    grew, held = (int(x) for x in out.stdout.split())
    experts_fp32 = 2 * 32 * 3 * 512 * 512 * 4
    assert held < experts_fp32 / 3  # the parameters: quantized experts + a few MB of the rest
    assert grew < held + 24e6, f"RSS grew {grew / 1e6:.0f} MB for {held / 1e6:.0f} MB of parameters"
    assert grew < experts_fp32 / 2
