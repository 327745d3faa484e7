"""The host's time to build one layer's TMA descriptors for the Gluon prefill attention (five a launch: q's two
blocks, k_nope, k_rope, v), which an eager prefill step pays every layer (a CUDA-graph step once, at capture). CPU
only: the descriptors are host objects, no GPU is touched. Min of 5 rounds of 2,000 layers.

    PYTHONPATH=$PWD python benchmarks/prefill_desc_host.py      # one JSON line
"""

from __future__ import annotations

import json
import time

import torch

from mlaserve.kernels import prefill_attention_gluon as g


def main() -> None:
    if not g.AVAILABLE:
        raise SystemExit("this Triton has no Gluon")
    q = torch.empty(2048, 16, 192, dtype=torch.bfloat16)  # a 2,048-token chunk over 8,192 keys, M1's 16 heads
    kv = torch.empty(8192, 16, 256, dtype=torch.bfloat16)
    kn, v = kv[:, :, :128], kv[:, :, 128:]
    kr = torch.empty(8192, 64, dtype=torch.bfloat16)

    def layer():
        return [
            g._desc(t, b)
            for t, b in ((q, [128, 128]), (q, [128, 64]), (kn, [128, 128]), (kr, [128, 64]), (v, [128, 128]))
        ]

    for _ in range(200):
        layer()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            layer()
        rounds.append((time.perf_counter() - t0) / 2000 * 1e6)
    print(json.dumps(dict(us_per_layer=round(min(rounds), 2), rounds_us=[round(r, 2) for r in rounds])))


if __name__ == "__main__":
    main()
