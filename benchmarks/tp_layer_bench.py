"""Per-layer decode time under tensor parallelism against one GPU, in the same run: a preset's shapes truncated in
depth (random weights in place), decode at the given batches, TPOT / layers, for each --tp in turn (attn-TP = MoE-TP;
--ep-size for EP). The issue's targets at Kimi-K2.5 shapes: TP2 <= 0.6x one GPU's per-layer time at batch 1 and 8,
TP4 <= 0.4x.

    PYTHONPATH=$PWD python benchmarks/tp_layer_bench.py --preset kimi-k2.5 --layers 4 --tp 1,2 --batches 1,8

Each engine is built, timed (benchmarks/bench_engine.ml_tpot) and closed before the next. Writes
$OUT/tp_layer_bench.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_engine import log, ml_tpot  # noqa: E402
from benchmarks.bench_util import code_id  # noqa: E402
from mlaserve.config import EngineConfig, ModelConfig, ParallelConfig  # noqa: E402


def build(cfg: EngineConfig, par: ParallelConfig, mcfg: ModelConfig):
    """-> (engine, close)."""
    from mlaserve.engine.engine import LLMEngine

    if par.world_size == 1:
        engine = LLMEngine(cfg, mcfg)
        return engine, lambda: None
    from mlaserve.distributed.engine_ranks import start_rank0, stop_rank0

    ranks, workers = start_rank0(cfg, par, mcfg)
    engine = LLMEngine(cfg, mcfg, ranks=ranks)

    def close():
        engine.runner.shutdown()
        stop_rank0(workers)

    return engine, close


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kimi-k2.5")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp", default="1,2", help="world sizes to run in turn, 1 first (the baseline)")
    ap.add_argument("--ep-size", type=int, default=None, help="EP instead of MoE-TP for world sizes > 1")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--gpu-mem", type=float, default=0.9)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (gloo ranks)")
    a = ap.parse_args()
    from mlaserve.models.make_random import load_preset

    raw = load_preset(a.preset)
    raw.pop("_note", None)
    (raw.get("text_config") or raw)["num_hidden_layers"] = a.layers
    path = f"/tmp/tp-layer-{a.preset}-{a.layers}"
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    mcfg = ModelConfig.from_pretrained(path)
    batches = [int(b) for b in a.batches.split(",")]
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    res = {"preset": a.preset, "layers": a.layers, "gpu": gpu, "runs": [], **code_id()}
    res["command"] = " ".join(sys.argv)
    for world in [int(w) for w in a.tp.split(",")]:
        par = ParallelConfig.from_tp(world, ep_size=a.ep_size if world > 1 else None)
        cfg = EngineConfig(
            model=path,
            device=a.device,
            load_format="dummy",
            gpu_memory_utilization=a.gpu_mem,
            enable_prefix_caching=False,
            max_num_seqs=max(batches),
            max_model_len=a.ctx + 256,
        )
        t = time.perf_counter()
        engine, close = build(cfg, par, mcfg)
        log(
            f"world {world} ({par.moe_tp_size} moe-tp x {par.ep_size} ep): engine up in {time.perf_counter() - t:.0f} s"
        )
        try:
            for b in batches:
                s, _, _, _ = ml_tpot(engine, b, a.ctx, mcfg.vocab_size, steps=a.steps)
                row = dict(
                    world=world, ep=par.ep_size, batch=b, ctx=a.ctx, tpot_ms=s * 1e3, layer_us=s * 1e6 / a.layers
                )
                res["runs"].append(row)
                log(f"  batch {b}: TPOT {row['tpot_ms']:.3f} ms, {row['layer_us']:.1f} us per layer")
        finally:
            close()
            del engine
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()
    base = {r["batch"]: r["layer_us"] for r in res["runs"] if r["world"] == 1}
    log(f"\n{a.preset}, {a.layers} layers, ctx {a.ctx}: per-layer decode time, and its ratio to one GPU's")
    for r in res["runs"]:
        ratio = r["layer_us"] / base[r["batch"]] if r["batch"] in base else float("nan")
        r["ratio"] = ratio
        log(f"  world {r['world']} ep {r['ep']} batch {r['batch']}: {r['layer_us']:8.1f} us  {ratio:.3f}x")
    out = os.path.join(os.environ.get("OUT", "."), "tp_layer_bench.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
