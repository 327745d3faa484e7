"""Tensor parallelism under CUDA graphs on 2 GPUs, with the Triton kernels' programmatic dependent launch beside the
NCCL all-reduces: greedy tokens of attn-TP2 x MoE-TP2 (and attn-TP2 x EP2) against one GPU, fp32 (must match)
and bf16 (batch-1 GEMVs and head GEMVs on; reported: TP changes the bf16 rounding of the reductions).

    PYTHONPATH=$PWD python benchmarks/tp_graph_check.py [--quick] [cpu]    # writes $OUT/tp_graph_check.json

PDL is on for TP ranks too (kernels/pdl.py); MLASERVE_PDL=0 turns it off: run it both ways to tell whether PDL matters.
Each stage prints its wall time as it ends, so a slow or stuck stage shows (session 6 saw two runs time out).
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlaserve import LLM, SamplingParams  # noqa: E402
from mlaserve.models.make_random import make_random  # noqa: E402


def greedy(ckpt, dtype, device, **par):
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 200))] for _ in range(8)]
    t0 = time.time()
    # a few small graphs (decode batch sizes up to 8, prefill buckets up to 1,024 tokens): a short capture
    if par and os.environ.get("TPCHECK_NO_OVERLAP") == "1":  # diagnosis: read each decode step back first
        par = dict(par, disable_overlap_schedule=True)
    llm = LLM(
        ckpt,
        device=device,
        dtype=dtype,
        num_pages=1024,
        page_size=64,
        max_num_seqs=8,
        prefill_graph_max_tokens=1024,
        **par,
    )
    print(f"  {dtype} {par or 'one GPU'}: engine up in {time.time() - t0:.1f} s", flush=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    print(f"  generated in {time.time() - t0:.1f} s", flush=True)
    graphs = bool(getattr(llm.engine.runner, "graphs", None) and llm.engine.runner.graphs.graphs)
    t1 = time.time()
    # session 8: close still hung with the NCCL communicator aborted; first see whether the GPU itself is idle (an
    # all-reduce that the other rank never joins would keep this synchronize waiting)
    faulthandler.dump_traceback_later(20, exit=True)
    torch.cuda.synchronize() if device == "cuda" else None
    faulthandler.cancel_dump_traceback_later()
    print(f"  GPU idle after {time.time() - t1:.1f} s", flush=True)
    # session 7: on two H200s TP2 generated and then LLM.close() never returned: if it hangs again, print rank 0's
    # stacks after 30 s and exit, so the device call shows where
    faulthandler.dump_traceback_later(30, exit=True)
    llm.close()
    faulthandler.cancel_dump_traceback_later()
    print(f"  closed in {time.time() - t1:.1f} s", flush=True)
    return [o.token_ids for o in outs], graphs


def main() -> int:
    args = sys.argv[1:]
    quick = "--quick" in args  # fp32, attn-TP2 x MoE-TP2 only
    device = "cpu" if "cpu" in args else "cuda"  # cpu: a gloo smoke run of this script
    tmp = tempfile.mkdtemp()
    rows, ok = [], True
    for dtype in ("float32", "bfloat16") if device == "cuda" and not quick else ("float32",):
        ckpt = make_random("tiny", os.path.join(tmp, dtype), seed=0, dtype=dtype, progress=False)
        ref, _ = greedy(ckpt, dtype, device)
        pars = [dict(attn_tp_size=2, moe_tp_size=2), dict(attn_tp_size=2, moe_tp_size=1, ep_size=2)]
        for par in pars[:1] if quick else pars:
            got, graphs = greedy(ckpt, dtype, device, **par)
            same = sum(a == b for a, b in zip(got, ref))
            first = sum(a[:4] == b[:4] for a, b in zip(got, ref))
            rows.append(
                dict(dtype=dtype, **par, graphs_on_rank0=graphs, same_sequences=same, of=len(ref), same_first4=first)
            )
            print(rows[-1], flush=True)
            if dtype == "float32" and same != len(ref):
                ok = False
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tp_graph_check.json"), "w") as f:
        json.dump(dict(rows=rows, ok=ok, pdl=os.environ.get("MLASERVE_PDL", "1")), f, indent=1)
    print("fp32 TP2 == TP1:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
