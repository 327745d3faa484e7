"""How many requests run in each of ml_tpot's timed steps, through the engine's own scheduler, on CPU with the tiny
model (scheduling only depends on lengths and the token budget). Session 15 found that the batch shrank inside the
window at an 8k context when each request had max_tokens = steps + 8 (the first prompts decode while the rest
prefill); bench_engine.ml_tpot now sizes max_tokens to leave room and raises if the batch changes.
    python benchmarks/tpot_window_check.py BATCH CTX [--max-tokens N]   (default: ml_tpot's; the old one was 40)
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_engine import start_batch, tpot_max_tokens  # noqa: E402
from mlaserve.config import EngineConfig  # noqa: E402
from mlaserve.engine.engine import LLMEngine  # noqa: E402
from mlaserve.models.make_random import make_random  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("batch", type=int)
    ap.add_argument("ctx", type=int)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--model", default="/tmp/tiny-window-check")
    a = ap.parse_args()
    if not os.path.isdir(a.model):
        make_random("tiny", a.model, seed=0, dtype="float32", progress=False)
    eng = LLMEngine(
        EngineConfig(
            model=a.model,
            device="cpu",
            max_num_seqs=max(32, a.batch),
            max_model_len=a.ctx + 128,
            enable_prefix_caching=False,
            kv_cache_memory_gb=4,
        )
    )
    max_tokens = a.max_tokens or tpot_max_tokens(eng, a.batch, a.ctx, a.steps)
    t = time.time()
    start_batch(eng, a.batch, a.ctx, eng.model_config.vocab_size, max_tokens)
    sizes = []
    for _ in range(a.steps):
        sizes.append(len(eng.scheduler.running))
        eng.step()
    print(
        f"batch {a.batch} ctx {a.ctx} max_tokens {max_tokens}: requests running at each timed step {sizes} "
        f"(mean {sum(sizes) / len(sizes):.1f}; {time.time() - t:.0f} s)"
    )


if __name__ == "__main__":
    main()
