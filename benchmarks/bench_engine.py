"""Whole-model speed on one GPU: mlaserve's TTFT and TPOT (and transformers' on the same weights, same run),
each beside its floor (bench/roofline.py). Writes JSON to --out and benchmarks/results/.

    python benchmarks/bench_engine.py --model /tmp/m1 --make moonlight-16b-a3b --hf          # M1 + transformers
    python benchmarks/bench_engine.py --preset kimi-k2.5 --layers 4 --dummy                  # M2, random in place
    python benchmarks/bench_engine.py --model /tmp/m1 --draft /tmp/m1-draft --spec-only      # EAGLE3 K=1 N=2
    python benchmarks/bench_engine.py --model /tmp/m1 --draft /tmp/m1-draft --replay-sweep  # vs acceptance
    python benchmarks/bench_engine.py --preset kimi-k2.5 --layers 4 --dummy --quantization int4-experts
    python benchmarks/bench_engine.py --preset deepseek-v3 --layers 6 --dummy --quantization fp8-block \
        --compare-unquantized                      # the same model in bf16 in the same run: TTFT side by side
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_util import code_id, sleep_cycles  # noqa: E402
from mlaserve.attention.base import SeqChunk  # noqa: E402
from mlaserve.bench.roofline import (  # noqa: E402
    HBM_BYTES_PER_S,
    decode_bytes,
    decode_floor_s,
    prefill_floor_s,
    total_params,
)
from mlaserve.config import EngineConfig, ModelConfig, SpecConfig  # noqa: E402
from mlaserve.types import SamplingParams  # noqa: E402


def log(*a):
    print(*a, flush=True)


def prompts(n, length, vocab, seed):
    rng = random.Random(seed)
    lo = min(1000, vocab // 4)  # keep clear of special ids at both ends
    return [[rng.randrange(lo, vocab - lo) for _ in range(length)] for _ in range(n)]


def gpu_state() -> dict | None:
    """SM clock, temperature and power now (nvidia-smi): batch 1 has read ~7 % slower, GPU time included, after
    transformers' sweep than without it; a throttled SM clock would show here."""
    import subprocess

    if not torch.cuda.is_available():
        return None
    try:
        q = (
            subprocess.run(
                [
                    "nvidia-smi",
                    "-i",
                    str(torch.cuda.current_device()),
                    "--format=csv,noheader,nounits",
                    "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active",
                ],
                capture_output=True,
                text=True,
                timeout=10,
            )
            .stdout.strip()
            .split(", ")
        )
        return dict(sm_mhz=float(q[0]), mem_mhz=float(q[1]), temp_c=float(q[2]), power_w=float(q[3]), throttle=q[4])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- mlaserve ----------------------------------------------------------------------------------------
def ml_ttft(engine, length, vocab, reps=3, around=contextlib.nullcontext, max_tokens=1):
    """Time from add_request to the event with the first token (one request alone; fresh prompts, so no prefix
    hit); `around()` wraps the last rep alone (a profiler). max_tokens 2: a speculative engine's draft extends over
    the prompt before that event, as for any request that goes on (one that ends at its first token skips it)."""
    times = []
    for r in range(reps + 1):
        p = prompts(1, length, vocab, seed=1000 + r)[0]
        sync()
        with around() if r == reps else contextlib.nullcontext():
            t = time.perf_counter()
            rid = engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            while not any(o.request_id == rid and o.new_token_ids for o in engine.step()):
                pass
            sync()
        if r:  # the first is a warm-up
            times.append(time.perf_counter() - t)
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times)


def tpot_max_tokens(engine, batch, ctx, steps, k: int | None = None) -> int:
    """max_tokens that keeps every request of an ml_tpot batch running through its timed window: with chunked prefill
    the first prompts finish early and decode while the rest prefill (a request ending inside the window would shrink
    the batch the figure is for; the batch-8 and batch-32 rows at an 8k context of 2026-11-30 before 8509d43 did)."""
    early = -(-batch * ctx // engine.cfg.max_num_batched_tokens)  # prefill steps: at most this many early steps
    k = engine.spec_k if k is None else k
    # a verify step emits up to k + 1 tokens, the early ones too; one more step may be in flight (overlap)
    return (early + 3 + steps + 1) * (k + 1) + 8


def start_batch(engine, batch, ctx, vocab, max_tokens) -> list[str]:
    """ml_tpot's batch: its prompts added, prefilled, and 3 warm-up decode steps run -> the request ids."""
    if ctx + max_tokens > engine.max_model_len:
        raise ValueError(f"ml_tpot: ctx {ctx} + {max_tokens} tokens exceeds max_model_len {engine.max_model_len}")
    rids = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        for p in prompts(batch, ctx, vocab, seed=batch * 7 + ctx)
    ]
    while any(
        r.num_computed_tokens < len(r.prompt_token_ids)
        for r in engine.scheduler.running + list(engine.scheduler.waiting)
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    return rids


def ml_tpot(engine, batch, ctx, vocab, steps=32, around=contextlib.nullcontext, replay=False):
    """-> (seconds per decode step, tokens per request-step, share of the timed steps launched overlapped,
    replay_alone_ms if `replay` else None); `around()` wraps the timed steps alone (a profiler). Raises if the batch
    changed inside the window (tpot_max_tokens)."""
    rids = start_batch(engine, batch, ctx, vocab, tpot_max_tokens(engine, batch, ctx, steps))
    sync()
    n_tok = 0
    ov0 = engine.num_overlapped_steps
    running0 = len(engine.scheduler.running)
    with around():
        t = time.perf_counter()
        for _ in range(steps):
            n_tok += sum(len(o.new_token_ids) for o in engine.step())
        sync()
        dt = time.perf_counter() - t
    if not running0 == len(engine.scheduler.running) == batch:
        raise RuntimeError(
            f"ml_tpot batch {batch} ctx {ctx}: {running0} requests ran at the first timed step and "
            f"{len(engine.scheduler.running)} at the last, not {batch}"
        )
    overlapped = (engine.num_overlapped_steps - ov0) / steps
    # while the requests still run: the graph of this batch's size last ran, on this batch's inputs (another graph
    # holds an older step's inputs)
    replay_ms = replay_alone_ms(engine, batch) if replay else None
    for rid in rids:  # the replays rewrote the last step's KV row and outputs: end the requests, not decode on
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return dt / steps, n_tok / (batch * steps), overlapped, replay_ms


def replay_alone_ms(engine, batch, reps=50):
    """The decode graph of a running ml_tpot batch replayed back to back on its last inputs: the GPU's time per
    step without the host's (scheduling, input copies, sampling, the token's trip back). TPOT minus this is
    host time the GPU waits for. None without graphs."""
    graphs = getattr(engine.runner, "graphs", None)
    key = ("decode", next((b for b in graphs.bs_list if b >= batch), None)) if graphs is not None else None
    g = graphs.graphs.get(key) if key else None
    if g is None or g.graph is None:
        return None
    for _ in range(3):
        g.graph.replay()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        g.graph.replay()
    sync()
    return (time.perf_counter() - t) / reps * 1e3


# ---- transformers ------------------------------------------------------------------------------------
def hf_bench(path, cases, ttft_lengths, vocab):
    from transformers import DeepseekV3ForCausalLM

    out = {}
    sync()
    t = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kw = {"device_map": dev} if dev == "cuda" else {}
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).eval()
    sync()
    out["load_s"] = time.perf_counter() - t
    with torch.no_grad():
        for n in ttft_lengths:
            ids = torch.tensor(prompts(1, n, vocab, 5), device=dev)
            model(ids)
            sync()
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                model(ids)
                sync()
                ts.append(time.perf_counter() - t)
            out[f"prefill_{n}_s"] = statistics.median(ts)
        for b, ctx in cases:
            ids = torch.tensor(prompts(b, ctx, vocab, 9), device=dev)
            mask = torch.ones_like(ids)
            kw = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
            try:
                model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
                sync()
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
                sync()
                t1 = time.perf_counter() - t
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=9, min_new_tokens=9, **kw)
                sync()
                out[f"tpot_b{b}_ctx{ctx}_s"] = (time.perf_counter() - t - t1) / 8
            except torch.OutOfMemoryError as e:
                out[f"tpot_b{b}_ctx{ctx}_s"] = None
                log("transformers OOM", b, ctx, e)
                torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def bench_spec(a) -> SpecConfig:
    """The K=1, N=2 speculation the bench times: the checkpoint's MTP layer (--mtp) or the EAGLE3 --draft."""
    if a.mtp:
        return SpecConfig(algorithm="MTP", num_steps=1, num_draft_tokens=2)
    return SpecConfig(draft_model=a.draft, num_steps=1, num_draft_tokens=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--make", default=None, help="preset to write a random checkpoint from, if --model is absent")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dummy", action="store_true")
    ap.add_argument(
        "--deterministic", action="store_true", help="--deterministic-inference (batch-invariant kernels) for mlaserve"
    )
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--draft", default=None)
    ap.add_argument(
        "--mtp",
        action="store_true",
        help="speculate with the checkpoint's MTP layer (K=1, N=2; DeepSeek-V3's); --make / --preset write it",
    )
    ap.add_argument("--spec-only", action="store_true")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--ttft", default="512,8192")
    ap.add_argument(
        "--ttft-reps", type=int, default=3, help="timed prefills per TTFT figure, their median (after one untimed)"
    )
    ap.add_argument("--label", default="m1")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--profile", action="store_true", help="print the top GPU kernels of a prefill and of decode")
    ap.add_argument(
        "--chunked-prefill-size", type=int, default=0, help="the largest prefill chunk (default: the engine's)"
    )
    ap.add_argument(
        "--host-profile", action="store_true", help="the host's functions (cProfile) over the longest --ttft prefill"
    )
    ap.add_argument(
        "--spec-ttft",
        action="store_true",
        help="with --draft / --mtp: also the --ttft prompts' TTFT on the speculative engine (and its prefill profiled)",
    )
    ap.add_argument(
        "--hf-last",
        action="store_true",
        help="run transformers after mlaserve, not before (whichever runs second in the process is "
        "slower at batch 1: mlaserve 2.11 vs 2.01 ms, transformers 128 vs 86 ms on 2026-11-30; "
        "docs/performance.md's table runs mlaserve first)",
    )
    ap.add_argument("--no-overlap", action="store_true", help="--disable-overlap-schedule (read each step back)")
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the engine's start-up warm-up (the timed shapes compile in their own untimed warm-up steps)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="the latent cache's dtype (fp8: e4m3, half the bytes a token; the TPOT floors count its bytes); the "
        "KV tokens the cache holds at --gpu-mem are recorded as kv_cache_tokens",
    )
    ap.add_argument(
        "--replay-sweep",
        action="store_true",
        help="TPOT against acceptance with the benchmark-only REPLAY draft (benchmarks/replay_sweep.py); with "
        "--draft its EAGLE3 forward runs each step",
    )
    ap.add_argument(
        "--simulate-sweep",
        action="store_true",
        help="the --replay-sweep table with the draft's simulated acceptance (--speculative-simulate-acceptance)"
        " instead of REPLAY (needs --draft or --mtp): holds at any context and overlaps, but the texts are not the"
        " model's",
    )
    ap.add_argument("--sweep-k", default="1,2,3", help="--replay-sweep: draft steps K")
    ap.add_argument("--sweep-acceptance", default="0,0.5,0.7,0.9,1.0", help="--replay-sweep: acceptance rates")
    ap.add_argument("--sweep-ctx", type=int, default=512, help="--replay-sweep: context length")
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int4-experts", "fp8-block"],
        help="--preset/--make: the checkpoint form (published quantization_config); default none (bf16)",
    )
    ap.add_argument(
        "--compare-unquantized",
        action="store_true",
        help="after the quantized model's rows, time the same model unquantized (bf16, dummy) in the same run: "
        "TTFT rows with the quantized/bf16 ratio",
    )
    ap.add_argument("--result-json", default=None, help=argparse.SUPPRESS)  # the bf16 twin's rows, for its parent
    a = ap.parse_args()
    if a.ttft_reps < 1:
        ap.error(f"--ttft-reps must be at least 1, got {a.ttft_reps}")
    if a.simulate_sweep and not (a.draft or a.mtp):
        ap.error("--simulate-sweep: the simulated acceptance runs a draft; give --draft DIR or --mtp")
    if a.replay_sweep and a.mtp:
        ap.error("--replay-sweep: REPLAY runs an EAGLE3 draft's forward (--draft); with --mtp use --simulate-sweep")
    os.makedirs(a.out, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    res = {
        "label": a.label,
        "gpu": gpu,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv),
        "ttft_reps": a.ttft_reps,
        **code_id(),
    }
    if a.model and a.make and not os.path.isdir(a.model):
        from mlaserve.models.make_random import make_random

        t = time.perf_counter()
        make_random(
            a.make,
            a.model,
            layers=a.layers,
            dtype="bfloat16",
            device="cuda",
            progress=False,
            quantization=a.quantization,
            mtp=a.mtp,
        )
        res["make_random_s"] = time.perf_counter() - t
        log(f"wrote {a.model} in {res['make_random_s']:.1f}s")
    if a.model:
        mcfg = ModelConfig.from_pretrained(a.model)
        path = a.model
    else:
        from mlaserve.models.make_random import make_random

        path = make_random(  # config.json alone: the weights are made in place (--dummy)
            a.preset,
            os.path.join("/tmp", f"cfg-{a.label}"),
            layers=a.layers,
            dtype="bfloat16",
            quantization=a.quantization,
            config_only=True,
            mtp=a.mtp,
        )
        mcfg = ModelConfig.from_pretrained(path)
    if a.draft and not os.path.isdir(a.draft):  # a random draft fitted to the target's config
        from mlaserve.models.make_random_draft import make_random_draft

        make_random_draft("kimi-k2.5-eagle3", a.draft, target=path, dtype="bfloat16")
    res["params_b"] = total_params(mcfg) / 1e9
    vocab = mcfg.vocab_size
    batches = [int(x) for x in a.batches.split(",")]
    ctxs = [int(x) for x in a.contexts.split(",")]
    ttfts = [int(x) for x in a.ttft.split(",")]

    hf_cases = [(b, c) for b in batches for c in ctxs if b * c <= 8 * 8192]
    if a.hf and not a.hf_last:
        res["transformers"] = hf_bench(path, hf_cases, ttfts, vocab)
        log("transformers:", json.dumps(res["transformers"]))

    twin = None
    if a.compare_unquantized:  # first, in a child process: its GPU memory is the driver's again when it exits
        twin = run_unquantized_twin(a)

    from mlaserve.engine.engine import LLMEngine

    cfg = EngineConfig(
        model=path,
        load_format="dummy" if a.dummy else "auto",
        gpu_memory_utilization=a.gpu_mem,
        enable_prefix_caching=False,
        max_num_seqs=max(batches),
        disable_overlap_schedule=a.no_overlap,
        deterministic=a.deterministic,
        warmup=not a.no_warmup,
        max_model_len=max(ctxs + ttfts) + 128,
        kv_cache_dtype=a.kv_cache_dtype,
        **({"chunked_prefill_size": a.chunked_prefill_size} if a.chunked_prefill_size else {}),
    )
    kvb = {"kv_dtype_bytes": 1} if a.kv_cache_dtype != "auto" else {}  # the floors read the cache's bytes
    sync()
    t = time.perf_counter()
    # the speculative engine shares this runner: its cache leaves the draft's memory free
    engine = LLMEngine(cfg, reserve_for=bench_spec(a) if a.draft or a.mtp else None)
    sync()
    res["mlaserve_load_s"] = engine.runner.load_seconds
    res["weight_bytes"] = vars(engine.runner.weight_bytes)
    log(engine.runner.weight_bytes.line())
    res["mlaserve_init_s"] = time.perf_counter() - t
    r = engine.runner
    res["kv_cache_dtype"] = str(r.kv_cache.dtype).removeprefix("torch.")
    res["kv_cache_pages"], res["kv_cache_tokens"] = r.num_pages, engine.cache_tokens
    res["kv_cache_gb"] = r.kv_cache.numel() * r.kv_cache.element_size() / 1e9
    log(f"KV cache {res['kv_cache_dtype']}: {res['kv_cache_tokens']} tokens in {res['kv_cache_gb']:.2f} GB")
    rows = Rows(res, a, twin)
    if not a.spec_only:
        for n in ttfts:
            s = ml_ttft(engine, n, vocab, reps=a.ttft_reps)
            fl = prefill_floor_s(mcfg, n)
            # a short prompt selects nearly every expert: the weights' bytes, not the FLOPs, bound it
            fb = decode_bytes(mcfg, 1, 0, q_len=n) / HBM_BYTES_PER_S
            rows.append(
                dict(
                    figure=f"TTFT {n} tokens",
                    ms=s * 1e3,
                    floor_ms=fl * 1e3,
                    ratio=s / fl,
                    bytes_floor_ms=fb * 1e3,
                    ratio_bytes=s / fb,
                    hf_key=f"prefill_{n}_s",
                )
            )
        for b in batches:
            for c in ctxs:
                before = gpu_state()
                s, tok, overlapped, replay_ms = ml_tpot(engine, b, c, vocab, replay=True)
                fl = decode_floor_s(mcfg, b, c, **kvb)
                rows.append(
                    dict(
                        figure=f"TPOT b{b} ctx{c}",
                        ms=s * 1e3,
                        floor_ms=fl * 1e3,
                        ratio=s / fl,
                        hf_key=f"tpot_b{b}_ctx{c}_s",
                        bytes_gb=decode_bytes(mcfg, b, c, **kvb) / 1e9,
                        replay_ms=replay_ms,
                        overlapped=overlapped,
                        gpu_before=before,
                        gpu_after=gpu_state(),
                    )
                )
    if a.draft or a.mtp:
        # Plain TPOT first: the speculative engine re-captures the shared runner's graphs for verify width 2.
        cases = [(b, c) for c in ctxs for b in batches]
        base = {(b, c): ml_tpot(engine, b, c, vocab)[0] for b, c in cases}
        spec = bench_spec(a)
        if a.mtp:
            method = "MTP"
            draft_label = "the checkpoint's MTP layer" + (", dummy weights" if a.dummy else "")
        else:
            method = "EAGLE3"
            # what the draft is, as far as its folder says: train-draft leaves train_draft.json beside it
            trained = os.path.exists(os.path.join(a.draft, "train_draft.json"))
            draft_label = "trained draft" if trained else f"draft {os.path.basename(os.path.normpath(a.draft))}"
        engine_spec = LLMEngine(cfg, runner=engine.runner, spec=spec)
        graph_runs = engine_spec.runner.graphs.static_runs if engine_spec.runner.graphs is not None else {}
        for b, c in cases:
            st0, g0 = engine_spec.stats(), engine_spec.loop.decode_only_steps
            sg0 = graph_runs.get("spec_step", 0)
            s, tok, overlapped, _ = ml_tpot(engine_spec, b, c, vocab)
            st, g1 = engine_spec.stats(), engine_spec.loop.decode_only_steps
            rows.append(
                dict(
                    figure=f"TPOT b{b} ctx{c} {method} K=1 N=2 ({draft_label})",
                    ms=s / tok * 1e3,
                    step_ms=s * 1e3,
                    tokens_per_step=tok,
                    plain_ms=base[b, c] * 1e3,
                    step_x_plain=s / base[b, c],
                    floor_ms=decode_floor_s(mcfg, b, c) * 1e3,
                    ratio=s / tok / decode_floor_s(mcfg, b, c),  # per token, against plain decode's floor
                    # the verify's own floor: two tokens a request read the experts both select
                    verify_floor_ms=decode_floor_s(mcfg, b, c, q_len=2) * 1e3,
                    step_x_verify_floor=s / decode_floor_s(mcfg, b, c, q_len=2),
                    accept_length=1 + st["spec_accepted_tokens"] / max(st["spec_steps"], 1),
                    # decode-only steps that verified, accepted and drafted on the device (one read back): 1.0
                    device_step_share=(st["spec_device_steps"] - st0["spec_device_steps"]) / max(g1 - g0, 1),
                    # timed verify steps launched while the one before was in flight (spec_loop.py): 1.0
                    overlapped=overlapped,
                    # of the device steps, those that were one replay of the step graph (engine/spec_graph.py)
                    step_graph_share=(graph_runs.get("spec_step", 0) - sg0) / max(g1 - g0, 1),
                )
            )
        if a.spec_ttft:  # the same prompts' TTFT with the draft (its prefill runs the draft over the prompt too)
            for n in ttfts:
                s = ml_ttft(engine_spec, n, vocab, reps=a.ttft_reps, max_tokens=2)
                fl = prefill_floor_s(mcfg, n)
                rows.append(dict(figure=f"TTFT {n} tokens {method}", ms=s * 1e3, floor_ms=fl * 1e3, ratio=s / fl))
    if a.profile and (a.draft or a.mtp):  # the speculative step's kernels and its host gaps (batch 1)
        pre = max(ttfts) if a.spec_ttft else 0
        res["profile_eagle3"] = profile(engine_spec, vocab, pre, "decode_b1_eagle3", ctx=ctxs[0])
    if a.replay_sweep or a.simulate_sweep:
        from benchmarks.replay_sweep import replay_sweep

        # the EAGLE3 engine's draft KV cache is held outside the runner's pool: free it before each K's engine
        # allocates its own
        engine_spec = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        if torch.cuda.is_available():  # plain decode's graphs again (a speculative engine above re-captured them)
            engine.runner.release_graphs()
            engine.runner.capture_graphs(1, engine.max_model_len)
        sweep, res["replay_break_even"] = replay_sweep(
            engine,
            cfg,
            mcfg,
            vocab,
            a.draft,
            [int(x) for x in a.sweep_k.split(",")],
            [float(x) for x in a.sweep_acceptance.split(",")],
            batches,
            a.sweep_ctx,
            a.out,
            simulate=a.simulate_sweep,
            mtp=a.mtp,
        )
        rows += sweep
    for r in twin or []:
        rows.append(dict(r, figure=f"{r['figure']}, unquantized bf16 (child process)"))
    if a.profile and not a.spec_only and engine is not None:
        res["profile"] = profile(engine, vocab, max(ttfts), ctx=ctxs[0])
    if a.host_profile and engine is not None:
        res["host_profile"] = host_profile(engine, vocab, max(ttfts))
    if a.hf and a.hf_last:  # transformers after mlaserve, once mlaserve's memory is back (its KV cache is most)
        engine = engine_spec = None  # noqa: F841
        gc.collect()
        torch.cuda.empty_cache()
        res["transformers"] = hf_bench(path, hf_cases, ttfts, vocab)
        log("transformers:", json.dumps(res["transformers"]))
    for r in rows:
        if "hf_key" in r:
            r["hf_ms"] = _ms(res, r.pop("hf_key"))
    res["rows"] = rows = list(rows)
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump(rows, f)
    log(
        f"\n{a.label} on {res['gpu']}  (params {res['params_b']:.2f} B; load {res['mlaserve_load_s']:.1f}s, "
        f"init incl. graphs {res['mlaserve_init_s']:.1f}s; transformers load {_get(res, 'load_s')})"
    )
    log(f"{'figure':44s} {'mlaserve ms':>12s} {'floor ms':>9s} {'x floor':>8s} {'transformers ms':>16s}")
    for r in rows:
        log(row_line(r))
    rows_save(res, a)


def row_line(r: dict) -> str:
    ratio = f"{r['ratio']:.2f}" if r.get("ratio") else "-"
    return (
        f"{r['figure']:44s} {r['ms']:12.2f} {r.get('floor_ms') or 0:9.2f} {ratio:>8} "
        f"{r['hf_ms'] if r.get('hf_ms') is not None else '-':>16}"
        + (
            f"   (graph replay alone {r['replay_ms']:.2f} ms, {100 * r['overlapped']:.0f}% overlapped)"
            if r.get("replay_ms")
            else ""
        )
        + (
            f"   ({r['ratio_bytes']:.2f} x the bytes' floor {r['bytes_floor_ms']:.2f} ms)"
            if r.get("ratio_bytes")
            else ""
        )
        + (f"   {r['quantized_over_bf16']:.3f} x bf16's {r['bf16_ms']:.2f} ms" if r.get("quantized_over_bf16") else "")
        + (f" [SM {r['gpu_after']['sm_mhz']:.0f} MHz, {r['gpu_after']['temp_c']:.0f} C]" if r.get("gpu_after") else "")
    )


def rows_save(res: dict, a) -> None:
    """res as JSON into --out, and on a GPU into benchmarks/results/ too (one name a run: each save replaces the
    last)."""
    name = res.setdefault("file", f"engine_{a.label}_{time.strftime('%Y%m%d-%H%M%S')}.json")
    dirs = [a.out] + ([os.path.join(os.path.dirname(__file__), "results")] if torch.cuda.is_available() else [])
    for d in dirs:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "w") as f:
            json.dump(res, f, indent=1, default=str)


class Rows(list):
    """The run's rows: each printed and the JSON saved as it is measured (a crash later keeps them). A row whose
    figure the bf16 twin measured too gets its time (bf16_ms) and the ratio (quantized_over_bf16)."""

    def __init__(self, res: dict, a, twin: list[dict] | None = None):
        super().__init__()
        self.res, self.a, self.twin = res, a, {r["figure"]: r for r in twin or []}
        res["rows"] = self

    def append(self, row: dict) -> None:
        tw = self.twin.get(row["figure"])
        if tw is not None:
            row.update(bf16_ms=tw["ms"], quantized_over_bf16=row["ms"] / tw["ms"])
        super().append(row)
        log("row:", row_line(row))
        rows_save(self.res, self.a)

    def __iadd__(self, rows):
        for r in rows:
            self.append(r)
        return self


def run_unquantized_twin(a) -> list[dict]:
    """The same model unquantized (bf16 dummy weights), timed the same way in a child process (TTFT at --ttft,
    TPOT at batch 1 and the first context): its GPU memory is free again before this process builds its engine, so
    the two never share the GPU. -> the child's rows."""
    import subprocess

    if a.preset is None:
        raise SystemExit("--compare-unquantized needs --preset (the bf16 twin is made from it)")
    out = os.path.join(a.out, f"twin-{a.label}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--preset", a.preset, "--dummy", "--quantization", "none"]
    cmd += ["--label", f"{a.label}-bf16", "--out", a.out, "--gpu-mem", str(a.gpu_mem), "--result-json", out]
    cmd += ["--batches", "1", "--contexts", a.contexts.split(",")[0], "--ttft", a.ttft, "--ttft-reps", str(a.ttft_reps)]
    cmd += ["--layers", str(a.layers)] if a.layers else []
    log("bf16 twin:", " ".join(cmd))
    if subprocess.run(cmd).returncode != 0:
        log("bf16 twin failed: no unquantized rows")
        return []
    with open(out) as f:
        return json.load(f)


def profile(engine, vocab, prefill_len, decode_name="decode_b1", ctx=512):
    """Where the time goes: the top GPU kernels of one long prefill (unless prefill_len is 0), and of 16 batch-1
    decode steps at context ctx alone (the request's prefill and warm-up steps run outside the profiler). Per-step
    figures divide by the step count. A decode profile also splits the steps' span into GPU-busy and idle time (the
    host's); every profile ends with its critical path (what each kernel adds to the span, PDL's overlapping waits
    taken out)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    out = {}
    steps = 16
    # a speculative engine's prefill with its draft's extend over the prompt (max_tokens 2: ml_ttft)
    mt = 2 if engine.spec_k else 1
    runs = [("prefill", 1, lambda around: ml_ttft(engine, prefill_len, vocab, reps=1, around=around, max_tokens=mt))]
    runs = (runs if prefill_len else []) + [
        (decode_name, steps, lambda around: ml_tpot(engine, 1, ctx, vocab, steps, around))
    ]
    for name, n, run in runs:
        cuda = torch.cuda.is_available()  # CPU: operator times (a check of this function)
        prof = tprofile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        run(lambda p=prof: p)
        rows = kernel_rows(prof, cuda)
        total = sum(r[1] for r in rows)
        top = [{"name": k[:90], "ms": ms, "count": c, "us_per_call": 1e3 * ms / c} for k, ms, c in rows]
        out[name] = {
            "total_ms": total,
            "passes": n,
            "ms_per_pass": total / n,
            "kernels_per_pass": sum(r[2] for r in rows) / n,
            "kernels": top,
        }
        log(f"\nprofile {name}: {total / n:.2f} ms of GPU time per pass, {sum(r[2] for r in rows) / n:.0f} kernels")
        for k, ms, c in rows[:30]:
            log(f"  {1e3 * ms / n:8.1f} us/pass {c / n:6.1f}x {1e3 * ms / c:7.2f} us  {k[:90]}")
        if cuda:
            busy, span = gpu_busy(prof)
            out[name].update(busy_us_per_pass=busy / n, span_us_per_pass=span / n)
            log(
                f"  GPU busy {busy / n:.1f} us of a {span / n:.1f} us step span (idle, waiting for the host: "
                f"{(span - busy) / n:.1f} us)"
            )
        if cuda:  # where the idle time sits (decode: summed over its steps by the ops on each side, a step's share)
            out[name]["gaps"] = gaps = idle_gaps(prof, passes=0 if name == "prefill" else n)
            for g in gaps:
                per = f" ({g['count']:.1f}x a pass)" if "count" in g else ""
                log(f"  idle {g['us']:8.1f} us{per} after {g['after']}, before {g['before']}")
        if cuda:
            out[name]["chain"] = chain = critical_path(prof, n)
            log(f"  critical path of {name} (each kernel's end minus the previous kernel's end, any stream):")
            for r in chain[:40]:
                log(
                    f"  {r['us_per_pass']:8.1f} us/pass {r['count_per_pass']:6.1f}x {r['us_per_call']:7.2f} us  "
                    f"{r['name']}"
                )
    return out


def host_profile(engine, vocab, length: int, top: int = 30) -> dict:
    """The host's side of one prefill of `length` tokens (after a warm-up one): cProfile's top functions by own time
    and by cumulative time, printed; -> {wall_ms, tottime: [(function, calls, s)], cumtime: [...]}."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    wall = ml_ttft(engine, length, vocab, reps=1, around=lambda: _profiling(prof))  # a warm-up prefill, then this
    out = {"wall_ms": 1e3 * wall, "length": length}
    if torch.cuda.is_available():
        out["enqueue"] = eager_enqueue(engine, vocab, length)
    st = pstats.Stats(prof)
    for key in ("tottime", "cumtime"):
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2 if key == "tottime" else 3])[:top]
        out[key] = [(f"{f[0].split('/')[-1]}:{f[1]}({f[2]})", v[1], v[2 if key == "tottime" else 3]) for f, v in rows]
        log(f"\nhost profile of a {length}-token prefill ({1e3 * wall:.1f} ms under cProfile), by {key}:")
        for name, calls, sec in out[key]:
            log(f"  {1e3 * sec:9.2f} ms {calls:7d}x  {name}")
    return out


def eager_enqueue(engine, vocab, length: int, chunk: int = 2048, reps: int = 5) -> dict:
    """The host's time to launch one eager forward (the last `chunk` tokens of a `length`-token prompt, the rest
    cached, as chunked prefill runs it) while the GPU is held busy by a sleep kernel: the host's work alone, free of
    the GPU's pace. A forward that waits for the stream anywhere takes at least the sleep (hidden_sync)."""
    r = engine.runner
    ps = r.cfg.page_size
    pages = list(range(1, 1 + -(-length // ps)))  # the engine is idle: any pages are free to write
    if len(pages) >= r.num_pages or chunk >= length:
        return {}
    ids = prompts(1, chunk, vocab, seed=7)[0]
    step = SeqChunk(ids, length - chunk, pages, "last")
    sleep_ms = 200.0
    cycles = sleep_cycles(sleep_ms)
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t = time.perf_counter()
        r.execute([], [step])
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        if i:  # the first warms the eager path
            times.append(1e3 * dt)
    ms = statistics.median(times)
    synced = ms > sleep_ms / 2
    log(
        f"\nhost time to launch one eager {chunk}-token chunk after {length - chunk} cached: {ms:.2f} ms (median of "
        f"{reps}; the GPU held by a {sleep_ms:.0f} ms sleep{': it waited on the stream inside' if synced else ''})"
    )
    return {"chunk": chunk, "cached": length - chunk, "ms": ms, "reps_ms": times, "hidden_sync": synced}


@contextlib.contextmanager
def _profiling(prof):
    prof.enable()
    try:
        yield prof
    finally:
        prof.disable()


def kernel_rows(prof, cuda: bool = True) -> list[tuple[str, float, int]]:
    """A profile's kernels (CPU: operators, by self time) -> [(name, total ms, calls)], most time first."""
    rows = []
    for e in prof.key_averages():
        us = e.device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, us / 1e3, e.count))
    return sorted(rows, key=lambda r: -r[1])


def gpu_busy(prof) -> tuple[float, float]:
    """-> (us during which at least one GPU op ran, us from the first op's start to the last one's end)."""
    iv = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not iv:
        return 0.0, 0.0
    busy, (cur_s, cur_e) = 0.0, iv[0]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + cur_e - cur_s, iv[-1][1] - iv[0][0]


def idle_gaps(prof, top: int = 8, passes: int = 0) -> list[dict]:
    """The longest stretches with no GPU op running (the host behind, or a wait on it), each with the op that ended
    before it and the one that started after it. passes > 0: the gaps between the same two ops summed, per pass
    (us, and count: how many a pass), so those that recur every step rank by what they cost a step."""
    ev = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    gaps = []
    if ev:
        end, last = ev[0].time_range.end, ev[0].name
        for e in ev[1:]:
            if e.time_range.start > end:
                gaps.append({"us": e.time_range.start - end, "after": last[:70], "before": e.name[:70]})
            if e.time_range.end > end:
                end, last = e.time_range.end, e.name
    if passes:
        by: dict[tuple, list[float]] = {}
        for g in gaps:
            by.setdefault((g["after"], g["before"]), []).append(g["us"])
        gaps = [{"us": sum(v) / passes, "count": len(v) / passes, "after": a, "before": b} for (a, b), v in by.items()]
    return sorted(gaps, key=lambda g: -g["us"])[:top]


def critical_path(prof, passes):
    """Under PDL a kernel's profiled duration includes its wait for the one before, so durations overlap and
    overstate. What a kernel adds to the step is its end minus the previous kernel's end (in end order over all
    streams): these sum to the profiled span. The first kernel of a step also takes the gap since the last step."""
    ev = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.end
    )
    acc: dict[str, list[float]] = {}
    for prev, e in zip(ev, ev[1:]):
        acc.setdefault(e.name[:90], []).append(e.time_range.end - prev.time_range.end)
    rows = [
        {"name": k, "us_per_pass": sum(v) / passes, "count_per_pass": len(v) / passes, "us_per_call": sum(v) / len(v)}
        for k, v in acc.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_pass"])


def _ms(res, key):
    v = res.get("transformers", {}).get(key)
    return None if v is None else round(v * 1e3, 2)


def _get(res, key):
    v = res.get("transformers", {}).get(key)
    return "-" if v is None else f"{v:.1f}s"


if __name__ == "__main__":
    main()
