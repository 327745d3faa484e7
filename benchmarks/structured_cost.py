"""The cost of structured output per decode step, beside plain greedy decode in the same run (issue: structured output).

For each batch size: the median decode step of
    plain         greedy requests (CUDA graphs, overlapped steps): the speed the grammar must leave unchanged
    no-overlap    the same with the overlapped loop off, which is what a step holding a grammar request takes
    json_schema   every request under a JSON schema with a free string (xgrammar's mask filled on the host while
                  the forward runs, copied and applied before sampling)
and, alone, the mask's two parts at the model's vocabulary: the host fill (one matcher per row) and the device apply.

    python benchmarks/structured_cost.py --preset moonlight-16b-a3b                # M1 shapes, random weights in place
    python benchmarks/structured_cost.py --preset moonlight-16b-a3b --layers 4 --batches 1,8 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mlaserve.config import EngineConfig  # noqa: E402
from mlaserve.types import SamplingParams, StructuredOutput  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}, "required": ["text"]}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_times(engine, prompts, params) -> tuple[list[float], int]:
    """Median-ready decode step times (s) after the prefill step, and the tokens generated."""
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # the prefill
    times, tokens = [], 0
    while engine.has_unfinished():
        sync()
        t = time.perf_counter()
        outs = engine.step()
        sync()
        times.append(time.perf_counter() - t)
        tokens += sum(len(o.new_token_ids) for o in outs)
    return times, tokens


def mask_parts(engine, B: int, reps: int = 50) -> dict:
    """The host fill of B rows' bitmasks and the device apply, each timed alone (ms)."""
    from mlaserve.layers.grammar_mask import apply_bitmask, fill_bitmasks

    so = StructuredOutput("json", json.dumps(SCHEMA))
    states = [engine.grammars.state(so) for _ in range(B)]
    for s in states:  # into the free string, where most tokens are allowed
        for t in engine.tokenizer.encode('{"text": "ab'):
            s.accept(t)
    V, dev = engine.model_config.vocab_size, engine.runner.device
    logits = torch.randn(B, V, device=dev)
    fill, apply = [], []
    for _ in range(reps):
        t = time.perf_counter()
        bm = fill_bitmasks(states, V, dev)
        sync()
        fill.append(time.perf_counter() - t)
        t = time.perf_counter()
        apply_bitmask(logits, list(range(B)), bm, logits)
        sync()
        apply.append(time.perf_counter() - t)
    return {"fill_ms": 1e3 * statistics.median(fill), "apply_ms": 1e3 * statistics.median(apply)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="moonlight-16b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="truncate to this many layers (default: all)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens per request")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    a = ap.parse_args()

    from mlaserve.engine.engine import LLMEngine
    from mlaserve.models.make_random import make_random

    path = make_random(a.preset, f"/tmp/cfg-structured-{a.preset}", layers=a.layers, dtype="bfloat16", config_only=True)
    batches = [int(x) for x in a.batches.split(",")]
    res = {"preset": a.preset, "layers": a.layers, "tokens": a.tokens, "device": dev_name(), "rows": []}
    so = StructuredOutput("json", json.dumps(SCHEMA), field="response_format")
    modes = {
        "plain": (False, SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)),
        "no-overlap": (True, SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)),
        "json_schema": (False, SamplingParams(temperature=0, max_tokens=a.tokens, structured=so)),
    }
    cfg = EngineConfig(
        model=path,
        load_format="dummy",
        enable_prefix_caching=False,
        max_num_seqs=max(batches),
        max_model_len=a.prompt_len + a.tokens + 64,
    )
    engine = LLMEngine(cfg)
    overlapped = engine.loop  # OverlapLoop(Loop): no-overlap steps the wrapped loop itself
    loops = {False: overlapped, True: getattr(overlapped, "loop", overlapped)}
    V = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(20261201)
    for B in batches:
        lo = min(1000, V // 4)  # clear of the special ids at both ends
        prompts = [torch.randint(lo, V - lo, (a.prompt_len,), generator=g).tolist() for _ in range(B)]
        row = {"batch": B}
        for name, (no_overlap, params) in modes.items():
            engine.loop = loops[no_overlap]
            step_times(engine, prompts, params)  # warm: graphs, the grammar compiled
            times, tokens = step_times(engine, prompts, params)
            row[name] = {"step_ms": 1e3 * statistics.median(times), "steps": len(times), "tokens": tokens}
        engine.loop = overlapped
        row["mask"] = mask_parts(engine, B)
        row["json_schema_vs_plain"] = row["json_schema"]["step_ms"] / row["plain"]["step_ms"] - 1
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    print("batch  plain ms  no-overlap ms  json_schema ms  (+%)   mask fill ms  apply ms")
    for r in res["rows"]:
        print(
            f"{r['batch']:5d}  {r['plain']['step_ms']:8.3f}  {r['no-overlap']['step_ms']:13.3f}  "
            f"{r['json_schema']['step_ms']:14.3f}  ({100 * r['json_schema_vs_plain']:+.1f})  "
            f"{r['mask']['fill_ms']:12.3f}  {r['mask']['apply_ms']:8.3f}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


def dev_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
