"""One MoE block on 2 ranks (attention TP2 layout: every rank holds the step's tokens): MoE-TP2 against EP2 with the
all-reduce combine and EP2 with the all-to-all dispatch and combine (layers/moe_a2a.py), per step of T tokens, to
find where the all-to-all starts to win (the crossover that KernelConfig.moe_a2a_min_tokens should sit at).

    PYTHONPATH=$PWD python benchmarks/ep_a2a_bench.py --preset kimi-k2.5 --tokens 8,32,128,256,512,1024,2048,4096,8192

A preset's first MoE block (random weights in place, its quantization), bf16 activations, the Triton MoE path,
eager (the all-to-all cannot be captured; decode-sized MoE-TP / EP all-reduce steps would run in CUDA graphs and be
faster still than shown). Each rank times `--iters` calls between CUDA events after a barrier; a form's time is the
slowest rank's. Writes $OUT/ep_a2a_bench.json. `--device cpu --preset tiny` is a smoke run (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mlaserve.config import ModelConfig, ParallelConfig  # noqa: E402
from mlaserve.distributed.launch import launch  # noqa: E402
from mlaserve.kernel_config import KernelConfig, use_kernels  # noqa: E402

FORMS = {"moe_tp": ParallelConfig(2, 2, 1), "ep_allreduce": ParallelConfig(2, 1, 2), "ep_a2a": ParallelConfig(2, 1, 2)}


def time_block(info, cfg_path: str, tokens: list[int], forms: list[str], device: str, iters: int) -> dict:
    """On each rank: build the block, time each form at each T -> {form: {T: seconds per call}}."""
    import torch.distributed as dist

    from mlaserve.distributed import tp
    from mlaserve.models.deepseek_v3 import DeepseekV3MoE
    from mlaserve.models.dummy_weights import init_dummy_weights

    cfg = ModelConfig.from_pretrained(cfg_path)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(dev):
        moe = DeepseekV3MoE(cfg, info, dtype, "triton" if device == "cuda" else "torch", cfg.first_k_dense_replace)
    init_dummy_weights(moe, seed=0)  # the same router on every rank: the all-reduce forms need it
    g = torch.Generator(device=dev).manual_seed(1)  # the same tokens on every rank
    out = {}
    for form in forms:
        use_kernels(moe, KernelConfig(moe_a2a_min_tokens=0 if form == "ep_a2a" else None))
        out[form] = {}
        for T in tokens:
            x = torch.randn(T, cfg.hidden_size, generator=g, device=dev, dtype=dtype)
            n = max(3, min(iters, iters * 256 // T))
            with torch.no_grad():
                for _ in range(2):
                    moe(x)
                if device == "cuda":
                    torch.cuda.synchronize()
                dist.barrier(group=tp.group())
                t0 = time.perf_counter()
                if device == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                for _ in range(n):
                    moe(x)
                if device == "cuda":
                    end.record()
                    torch.cuda.synchronize()
                    s = start.elapsed_time(end) / 1e3 / n
                else:
                    s = (time.perf_counter() - t0) / n
            out[form][T] = s
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kimi-k2.5")
    ap.add_argument("--tokens", default="8,32,128,256,512,1024,2048,4096,8192")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--iters", type=int, default=20, help="calls timed at 256 tokens (more below, fewer above)")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    from mlaserve.models.make_random import load_preset

    raw = load_preset(a.preset)
    raw.pop("_note", None)
    path = f"/tmp/ep-a2a-{a.preset}"
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    tokens, forms = [int(t) for t in a.tokens.split(",")], a.forms.split(",")
    res = {"preset": a.preset, "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "runs": []}
    res["command"] = " ".join(sys.argv)
    times = {}
    for par in dict.fromkeys(FORMS[f] for f in forms):  # one launch per layout, its forms in it
        mine = [f for f in forms if FORMS[f] == par]
        per_rank = launch(par, time_block, path, tokens, mine, a.device, a.iters, device=a.device, timeout_s=1800)
        for f in mine:
            times[f] = {T: max(r[f][T] for r in per_rank) for T in tokens}
    print(f"{a.preset}: one MoE block on 2 ranks, us per call (slowest rank), eager")
    print(f"{'T':>6} " + " ".join(f"{f:>13}" for f in forms) + "   a2a / best other")
    for T in tokens:
        row = {f: times[f][T] * 1e6 for f in forms}
        others = [row[f] for f in forms if f != "ep_a2a"]
        ratio = row["ep_a2a"] / min(others) if "ep_a2a" in row and others else float("nan")
        res["runs"].append(dict(tokens=T, **{f"{f}_us": v for f, v in row.items()}, a2a_ratio=ratio))
        print(f"{T:>6} " + " ".join(f"{row[f]:13.1f}" for f in forms) + f"   {ratio:.3f}")
    out = os.path.join(os.environ.get("OUT", "."), "ep_a2a_bench.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
