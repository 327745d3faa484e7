"""The W8A8 MoE's activation quantization in the experts' row order (act_quant with sorted_pairs): DeepSeek-V3's
prefill step, 8,192 tokens of 7,168 channels, 8 of 256 experts, rows in moe_align's order (64-row blocks); the
mean of 20 calls after 3, with a checksum of the rows so that two trees' outputs can be compared.

    PYTHONPATH=$PWD python benchmarks/act_quant_sorted.py --label new
    PYTHONPATH=/path/to/an/older/checkout python benchmarks/act_quant_sorted.py --label old   # its baseline

Writes $OUT/act_quant_sorted_<label>.json (OUT defaults to ./out). Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from mlaserve.kernels.fp8_quant import act_quant
from mlaserve.kernels.moe_align import moe_align


def source_sha1() -> str:
    """bench_util.code_id's hash of mlaserve/**/*.py, of the package this process imported (the tree measured)."""
    import hashlib
    import pathlib

    pkg = pathlib.Path(__import__("mlaserve").__file__).resolve().parent
    h = hashlib.sha1()
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg.parent)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="run")
    ap.add_argument("--tokens", type=int, default=8192)
    a = ap.parse_args()
    torch.manual_seed(0)
    M, D, E, K = a.tokens, 7168, 256, 8
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    topk = torch.rand(M, E, device="cuda").topk(K, dim=1).indices.to(torch.int32)
    sorted_ids, _, num_padded = moe_align(topk, E, 0, 64)

    def call():
        return act_quant(x, 128, sorted_pairs=(sorted_ids, num_padded, K))

    q, s = call()
    n = int(num_padded.item())
    checksum = [q[:n].view(torch.uint8).double().sum().item(), s[:n].double().sum().item()]
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        call()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) / 20 * 1e3
    src = source_sha1()
    print(f"{a.label}: {us:.1f} us for {n} rows of {D} ({M} tokens x {K}), checksum {checksum}, source {src}")
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    res = dict(
        label=a.label,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        source_sha1=src,
        tokens=M,
        shape=dict(D=D, E=E, K=K),
        rows=n,
        us=us,
        checksum=checksum,
    )
    with open(os.path.join(out_dir, f"act_quant_sorted_{a.label}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
