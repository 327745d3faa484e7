"""Speed of speculative decoding against acceptance, on real shapes, with the benchmark-only REPLAY draft.

For each batch: plain TPOT first (bench_engine.ml_tpot), then the plain greedy outputs of the same prompts recorded.
For each K, one REPLAY engine on the same runner (its verify graphs at width K+1; with --draft the EAGLE3 draft's
forward and graphs run each step and only its tokens are replaced) replaying its own greedy outputs (recorded with
every draft a miss), and for each acceptance a (miss rate 1 - a) its TPOT per token. Rows: per-token TPOT,
speedup over plain, tokens per step and the acceptance per position measured;
then the break-even acceptance per (K, batch), interpolated where the speedup crosses 1.

    python benchmarks/bench_engine.py --model /tmp/m1 --draft /tmp/m1-draft --replay-sweep --batches 1,8 --out $OUT
"""

from __future__ import annotations

import gc
import os

import torch

from benchmarks.bench_engine import log, ml_tpot, prompts, tpot_max_tokens
from mlaserve.bench.roofline import decode_floor_s
from mlaserve.config import SpecConfig
from mlaserve.types import SamplingParams


def record_greedy(engine, batch: int, ctx: int, vocab: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The plain engine's greedy outputs of ml_tpot's prompts for this batch and context."""
    ps = prompts(batch, ctx, vocab, seed=batch * 7 + ctx)
    rids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)) for p in ps]
    outs = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    return [(p, outs[r]) for p, r in zip(ps, rids)]


def break_even(points: list[tuple[float, float]]) -> float | None:
    """The acceptance where the speedup crosses 1 (linear between measured points); None if it never does."""
    pts = sorted(points)
    if pts and pts[0][1] >= 1:
        return pts[0][0]
    for (a0, s0), (a1, s1) in zip(pts, pts[1:]):
        if s0 < 1 <= s1:
            return a0 + (1 - s0) * (a1 - a0) / (s1 - s0)
    return None


def replay_sweep(
    engine,
    cfg,
    mcfg,
    vocab: int,
    draft: str | None,
    ks,
    accs,
    batches,
    ctx: int,
    out_dir: str,
    simulate=False,
    mtp=False,
):
    """simulate: the EAGLE3 draft (mtp: the checkpoint's MTP layer) with SpecConfig.simulate_acceptance instead of
    REPLAY (no recording: the acceptance is drawn whatever the target computes, so it holds at any context, and the
    steps overlap)."""
    from mlaserve.engine.engine import LLMEngine
    from mlaserve.spec.replay import read_recordings, write_recordings

    base, recs = {}, []
    longest = max(tpot_max_tokens(engine, b, ctx, 32, max(ks)) for b in batches)
    for b in batches:
        base[b] = ml_tpot(engine, b, ctx, vocab)[0]  # plain decode: one token per step
        if not simulate:
            recs += record_greedy(engine, b, ctx, vocab, longest)
    path = os.path.join(out_dir, "replay_sweep_recordings.jsonl")
    if not simulate:
        write_recordings(path, recs)
    rows = []
    what = ("MTP " if mtp else "") + ("SIMULATED" if simulate else "REPLAY")
    for k in ks:
        if simulate:
            who = dict(algorithm="MTP") if mtp else dict(draft_model=draft)
            spec = SpecConfig(**who, num_steps=k, num_draft_tokens=k + 1, simulate_acceptance=0.0)
        else:
            spec = SpecConfig(
                algorithm="REPLAY", draft_model=draft, num_steps=k, num_draft_tokens=k + 1, replay_path=path
            )
        eng = LLMEngine(cfg, runner=engine.runner, spec=spec)
        if not simulate:
            # The recording replayed at width K + 1 is that engine's own greedy output (every draft a miss): in
            # bf16 a verify row of width 3+ can round differently from a decode row, and a target that leaves the
            # recording gets no replayed drafts at all.
            eng.proposer.rate = 1.0
            own = [r for b in batches for r in record_greedy(eng, b, ctx, vocab, longest)]
            same = sum(o == p_out for (_, o), (_, p_out) in zip(own, recs))
            log(f"K={k}: {same} of {len(own)} verify-width greedy outputs equal plain decode's")
            kpath = os.path.join(out_dir, f"replay_sweep_recordings_k{k}.jsonl")
            write_recordings(kpath, own)
            eng.proposer.recordings, eng.proposer.tracks = read_recordings(kpath), {}
        for a in accs:
            if simulate:
                eng.loop.set_simulated_acceptance(a)  # the same engine and graphs for every acceptance
            else:
                eng.proposer.rate = 1.0 - a
            for b in batches:
                st0, g0 = eng.stats(), eng.loop.decode_only_steps
                s, tok, overlapped, _ = ml_tpot(eng, b, ctx, vocab)
                st1, g1 = eng.stats(), eng.loop.decode_only_steps
                n = max(st1["spec_steps"] - st0["spec_steps"], 1)
                measured = [
                    (x - y) / n for x, y in zip(st1["spec_accepted_per_position"], st0["spec_accepted_per_position"])
                ]
                floor = decode_floor_s(mcfg, b, ctx)
                rows.append(
                    dict(
                        figure=f"TPOT b{b} ctx{ctx} {what}(benchmark-only) K={k} a={a:.2f}",
                        k=k,
                        batch=b,
                        acceptance=a,
                        ms=s / tok * 1e3,
                        step_ms=s * 1e3,
                        tokens_per_step=tok,
                        plain_ms=base[b] * 1e3,
                        speedup=base[b] / (s / tok),
                        measured_acceptance_per_position=measured,
                        # decode-only steps that verified, accepted and drafted on the device (one read back): 1.0
                        device_step_share=(st1["spec_device_steps"] - st0["spec_device_steps"]) / max(g1 - g0, 1),
                        overlapped=overlapped,  # timed steps launched while the one before was in flight
                        floor_ms=floor * 1e3,
                        ratio=s / tok / floor,
                        verify_floor_ms=decode_floor_s(mcfg, b, ctx, q_len=k + 1) * 1e3,  # the step's own floor
                    )
                )
                log(
                    f"{rows[-1]['figure']}: {rows[-1]['ms']:.3f} ms/token ({s * 1e3:.3f} ms/step, {tok:.2f} tok/step),"
                    f" plain {base[b] * 1e3:.3f} ms: x{rows[-1]['speedup']:.3f}; measured per position "
                    + ", ".join(f"{m:.3f}" for m in measured)
                    + f"; device steps {100 * rows[-1]['device_step_share']:.0f}%, overlapped {100 * overlapped:.0f}%"
                )
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    even = {
        f"K={k} b{b}": break_even([(r["acceptance"], r["speedup"]) for r in rows if r["k"] == k and r["batch"] == b])
        for k in ks
        for b in batches
    }
    log(
        "break-even acceptance (speedup 1): "
        + ", ".join(f"{n} {v if v is None else round(v, 3)}" for n, v in even.items())
    )
    return rows, even
