"""Start-up warm-up: run every step shape the engine can launch eagerly, so that no Triton kernel compiles while
serving.

A Triton kernel compiles once per variant: its constexprs (tile sizes picked from the token count, GEMV or GEMM
forms, the MoE's BLOCK_M band) and the specialization of its other arguments (an int equal to 1 or divisible by 16,
a pointer 16-byte aligned; a slice of the step's metadata at the decode rows moves a pointer by the decode count).
CUDA graphs compile their fixed shapes when they are captured; the steps no graph fits run eagerly at any size:
mixed steps the two graphs do not take (engine/runner.py), prefill chunks past the context graphs (over cached
context: prefix hits, a long prompt's later chunks), more prefill requests than a graph holds, prompt-logprobs
prefills, and every step under enforce_eager. The plan visits, for those, every decode count up to max_num_seqs
(with both residues of the step's tokens mod 16 and page tables of 1, 16 and 17 columns), and prefill chunks at a
ladder of token counts with every threshold a kernel picks its form by on both sides of it. EAGLE3 drafts extend
over the same chunks. Pages are reused freely: the cache holds nothing yet.

MLA decode compiles per page-table width class (1, a multiple of 16, other: its row stride) and per form, which the
decode count picks (batch 1-3's tiles, one split at large batches): ranges of consecutive counts. Each count's steps
take two of the three widths, in turn, so any two consecutive counts see all three, and the first and last counts
(a range may hold only one of them) all three. A width counts the pages held for the EAGLE3 lookahead too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..attention.base import SeqChunk
from ..kernels.moe_config import FP8_ROW_BANDS, INT4_ROW_BANDS, ROW_BANDS
from .cuda_graph import PREFILL_MAX_REQS, PREFILL_TOKEN_BUCKETS

log = logging.getLogger("mlaserve.warmup")

DENSE_TOKENS = 48  # every token count up to this: the small-step thresholds (GEMV rows, split-K router, fusion)
LADDER_RATIO = 1.25  # above DENSE_TOKENS, a count every 25 % (the MoE bands are 3x wide), each also plus one


@dataclass(frozen=True)
class WarmupStep:
    """One eager step: `decode` requests of `q_len` tokens each at `context` tokens cached, and `prefill` tokens
    after `cached` cached ones (0: none), in one chunk or split over `requests` chunks."""

    decode: int
    q_len: int
    context: int
    prefill: int
    cached: int
    requests: int = 1

    @property
    def tokens(self) -> int:
        return self.decode * self.q_len + self.prefill


def token_edges(kernels, num_experts: int, top_k: int, n_shared: int, ep_size: int = 1) -> list[int]:
    """Token counts at which a kernel changes its form: KernelConfig's thresholds and the MoE tile bands of
    kernels/moe_config.py (rows per expert T*K/E at its ROW_BANDS, FP8_ROW_BANDS and INT4_ROW_BANDS; one row per
    expert at T*K = E), for the experts one rank holds with and without the fused shared slots."""
    edges = [
        kernels.gemv_serve_tokens,
        kernels.head_gemv_max_tokens,
        kernels.fuse_shared_max_tokens,
        kernels.router_splitk_max_tokens,
        kernels.fp8_a8_min_tokens,
        kernels.fp8_linear_a8_min_tokens,
        kernels.fp8_gemv_max_rows,
        kernels.fp8_scaled_mm_min_rows,
    ]
    if num_experts and top_k:
        edges += [kernels.no_align_max_pairs // top_k, kernels.int4_gemv_max_pairs // top_k]
        for e in {num_experts // max(ep_size, 1) + s for s in (0, n_shared)}:
            bands = sorted({*ROW_BANDS, *FP8_ROW_BANDS, *INT4_ROW_BANDS})
            edges += [e // top_k] + [rows * e // top_k for rows in bands]
    return sorted({e for e in edges if e > 0})


def token_ladder(lo: int, hi: int, edges: list[int] = ()) -> list[int]:
    """Token counts in [lo, hi]: every one up to DENSE_TOKENS, then a count every LADDER_RATIO rounded to 16 and that
    plus one (both specializations), each edge with its neighbours and the multiples of 16 around it, and hi."""
    out = set(range(lo, min(hi, DENSE_TOKENS) + 1))
    v = float(DENSE_TOKENS)
    while v < hi:
        v *= LADDER_RATIO
        t = int(v + 8) // 16 * 16
        out |= {t, t + 1}
    for e in edges:
        out |= {e - 1, e, e + 1, e + 2, e // 16 * 16, e // 16 * 16 + 16, e // 16 * 16 + 17}
    out |= {t for k in range(4, hi.bit_length() + 1) for t in (1 << k, (1 << k) + 1)}  # powers of two
    out |= {t for b in PREFILL_TOKEN_BUCKETS for t in (b, b + 1)}  # the prefill graph buckets
    out |= {hi - 1, hi}
    return sorted(t for t in out if lo <= t <= hi)


def plan(
    decode_q_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    chunked_prefill_size: int,
    page_size: int,
    max_model_len: int,
    edges: list[int] = (),
    decode_only: bool = False,
    lookahead: int = 0,
    eager_decode_from: int | None = None,
) -> list[WarmupStep]:
    """The eager steps to run at start-up. decode_only: decode-only steps run eagerly too (no CUDA graphs);
    eager_decode_from: those of this many requests or more do (more than the largest decode graph holds, as under
    EP's all-to-all edge). lookahead: the tokens past a step's own that its chunks' pages cover (_chunks), which
    widen the page table."""
    q, budget = decode_q_len, max_num_batched_tokens
    chunk = min(chunked_prefill_size, budget)
    # decode contexts whose page tables (with the lookahead's pages and the step's other chunks) are 1, 16 and 17
    # columns wide
    contexts = [w * page_size - q - lookahead for w in (1, 16, 17)]
    contexts = [c for c in contexts if 0 <= c and c + q < max_model_len] or [0]
    steps: list[WarmupStep] = []
    prefills = token_ladder(1, chunk, edges)
    for cached in (0, page_size):  # fresh prefills, and chunks after cached context (prefix hits, chunked prompts)
        for p in prefills:
            if cached + p < max_model_len:
                steps.append(WarmupStep(0, q, 0, p, cached))
    # prefills of more requests than a prefill graph holds (always eager), fresh and after cached context
    if max_num_seqs > PREFILL_MAX_REQS:
        n = PREFILL_MAX_REQS + 1
        for cached in (0, page_size):
            steps += [
                WarmupStep(0, q, 0, p, cached, n) for p in prefills if p >= n and cached + -(-p // n) < max_model_len
            ]
    for n in range(1, max_num_seqs + 1):
        # two of the page-table widths in turn, all three at the first and last counts (the module docstring); in
        # the contexts' order, so the one-page context takes the smaller prefill chunk below (one page too, where
        # the page holds it and the lookahead)
        turn = {contexts[(n + i) % len(contexts)] for i in range(3 if n in (1, max_num_seqs) else 2)}
        ctxs = [c for c in contexts if c in turn]
        room = budget - n * q
        mixed = max_num_seqs >= 2 and room >= 1  # else one request at a time, or no token left for a prefill
        if decode_only or (eager_decode_from is not None and n >= eager_decode_from):
            # without mixed steps, the decode-only ones take the widths
            steps += [WarmupStep(n, q, c, 0, 0) for c in (ctxs[:1] if mixed else ctxs)]
        if not mixed:
            continue
        fill = -(n * q) % 16 or 16  # the step's tokens a multiple of 16, then not
        fills = (min(fill, room), min(fill + 1, room))
        pairs = [(ctxs[i % len(ctxs)], fills[i % 2]) for i in range(max(2, len(ctxs)))]
        steps += [WarmupStep(n, q, c, p, 0) for c, p in dict.fromkeys(pairs)]
    if max_num_seqs >= 2:  # large mixed steps: a prefill chunk at every ladder count beside a decode
        steps += [WarmupStep(1, q, contexts[0], p, 0) for p in prefills if q + p <= budget]
    return steps


def _chunks(
    step: WarmupStep, num_pages: int, page_size: int, lookahead: int = 0
) -> tuple[list[SeqChunk], list[SeqChunk]]:
    """Host chunks for a step; page ids cycle through the cache (its contents do not matter yet). Each chunk's
    pages also cover `lookahead` more tokens: the EAGLE3 chain writes its K - 1 later draft tokens past the step's."""
    nxt = 0

    def pages(n_tokens: int) -> list[int]:
        nonlocal nxt
        n = -(-n_tokens // page_size)
        ids = [(nxt + i) % num_pages for i in range(n)]
        nxt = (nxt + n) % num_pages
        return ids

    q, ctx = step.q_len, step.context  # every decode row has logits (a verify's N rows, as the spec loop asks)
    decode = [SeqChunk([1] * q, ctx, pages(ctx + q + lookahead), "all") for _ in range(step.decode)]
    prefill = []
    for i in range(step.requests if step.prefill else 0):  # the tokens split as evenly as they go
        n = step.prefill // step.requests + (i < step.prefill % step.requests)
        prefill.append(SeqChunk([1] * n, step.cached, pages(step.cached + n + lookahead)))
    return decode, prefill


def _draft(proposer, decode: list[SeqChunk], prefill: list[SeqChunk], aux: torch.Tensor | None) -> None:
    """The EAGLE3 draft's eager extension over the step's chunks (as the speculative loop's mixed steps run it):
    verify rows with all drafts accepted, then the prefill chunk, each proposing."""
    from ..spec.eagle3 import DraftChunk

    if aux is None:
        return
    chunks, row = [], 0
    for i, c in enumerate(decode + prefill):
        n = len(c.token_ids)
        req = SimpleNamespace(request_id=f"warmup-{i}", pages=c.pages)
        chunks.append(
            DraftChunk(req, c.token_ids, c.num_cached, aux[row : row + n], propose=True, verify=i < len(decode))
        )
        row += n
    proposer.propose(chunks)


def _step(runner, decode: list[SeqChunk], prefill: list[SeqChunk], draft, eager: bool = False) -> None:
    from ..layers.sampler import greedy_tokens

    logits, aux, _ = runner.execute(decode, prefill, eager=eager)
    greedy_tokens(logits, runner.kernels.pdl)  # the sampler's arg-max over the step's rows
    if logits.is_cuda and logits.shape[0]:  # and its race for sampled rows (kernels/race_sample.py)
        from ..kernels.race_sample import warm_race_sample

        warm_race_sample(logits, runner.kernels.pdl)
    if draft is not None:
        _draft(draft, decode, prefill, aux)


@torch.inference_mode()
def _eager_decode_from(graphs) -> int | None:
    """The decode-only steps' request count from which no graph holds them (None: every count has one)."""
    if graphs is None:
        return None  # plan's decode_only
    return graphs.bs_list[-1] + 1 if graphs.bs_list else 1


def warm_up(engine, steps: list[WarmupStep] | None = None) -> float:
    """Run the warm-up steps through the engine's runner (and its EAGLE3 draft); -> seconds taken (logged)."""
    runner, cfg = engine.runner, engine.cfg
    draft = engine.proposer if engine.spec_k and hasattr(engine.proposer, "draft") else None  # EAGLE3, not REPLAY
    lookahead = engine.spec_k if draft is not None else 0
    if steps is None:
        mc = engine.model_config
        edges = token_edges(
            runner.kernels,
            getattr(mc, "n_routed_experts", 0) or 0,
            getattr(mc, "num_experts_per_tok", 0) or 0,
            getattr(mc, "n_shared_experts", 0) or 0,
            runner.ranks.ep_size,
        )
        steps = plan(
            engine.spec_k + 1,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.chunked_prefill_size,
            cfg.page_size,
            engine.max_model_len,
            edges,
            decode_only=runner.graphs is None,
            lookahead=lookahead,
            eager_decode_from=_eager_decode_from(runner.graphs),
        )
    t0 = time.perf_counter()
    # the greedy speculative step's bookkeeping kernels, for a proposer that drafts on the device (EAGLE3, NGRAM)
    ngram = engine.spec_k and engine.spec is not None and engine.spec.is_ngram
    if (draft is not None or ngram) and runner.device.type == "cuda":
        from ..kernels.spec_step import warm_up as warm_spec_step

        warm_spec_step(engine.spec_k + 1, cfg.page_size, runner.device, runner.kernels.pdl)
        if ngram:
            engine.proposer.warm_up()
    for step in steps:
        decode, prefill = _chunks(step, runner.num_pages, cfg.page_size, lookahead)
        _step(runner, decode, prefill, draft)
        graphed = runner.graphs is not None and (
            runner.graphs.key_for(decode, prefill) or runner.split_keys(decode, prefill)
        )
        if graphed:
            # the same step eagerly, on every rank (runner.execute's eager): a prompt-logprobs prefill runs so, and
            # a mixed step the two graphs do not take (past MIXED_SPLIT_MAX_TOKENS)
            _step(runner, decode, prefill, draft, eager=True)
    if runner.ranks.world_size > 1:
        runner.park()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - t0
    log.info("warm-up: %d eager step shapes (kernel variants compiled) in %.1fs", len(steps), seconds)
    return seconds
