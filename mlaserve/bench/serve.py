"""`mlaserve bench serve`: stream random token-id prompts at a running OpenAI-compatible server, time every event,
and write the docs/benchmarking.md figures (plus per-request outputs for `bench compare`) to a result JSON."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from .client import RequestRecord, completion_payload, send_request
from .metrics import acceptance_by_position, counter, counters_by_label, parse_prometheus, summarize_run
from .prompts import (
    DEFAULT_VOCAB_SIZE,
    WARMUP_PREFIX_STREAM,
    WARMUP_STREAM,
    poisson_arrivals,
    prompts_sha256,
    random_prompts,
    special_ids_from_card,
    with_shared_prefix,
)
from .report import dumps_result, format_summary, provenance

log = logging.getLogger(__name__)

SCHEMA = "mlaserve.bench.serve/1"
# /metrics counters scraped before and after the run; matched by suffix so vllm:/sglang: prefixes work too
COUNTERS = {
    "spec_steps": "spec_decode_num_drafts_total",
    "draft_tokens": "spec_decode_num_draft_tokens_total",
    "accepted_tokens": "spec_decode_num_accepted_tokens_total",
    "generation_tokens": "generation_tokens_total",
    "prompt_tokens": "prompt_tokens_total",
}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"  # labelled by position ("0": the first draft token)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    p.add_argument("--model", default=None, help="model id to request (default: the first id from /v1/models)")
    p.add_argument("--num-prompts", type=int, default=8, help="requests in the run (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson arrivals drawn from --seed (default: inf, all at once)",
    )
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (default: %(default)s)")
    p.add_argument(
        "--prefix-len",
        "--random-prefix-len",
        dest="prefix_len",
        type=int,
        default=0,
        help="tokens of one random prefix every prompt starts with, before its --input-len own (a shared system "
        "prompt; vLLM's --random-prefix-len): the first request fills the server's prefix cache and the others can "
        "hit it; the warm-ups share another prefix (default: 0)",
    )
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default: %(default)s)")
    p.add_argument("--seed", type=int, default=20260724, help="prompt (and arrival) seed (default: %(default)s)")
    p.add_argument("--num-warmups", type=int, default=0, help="untimed requests before the run (default: 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"draw prompt ids from [0, N) (default: /v1/models' vocab_size, else {DEFAULT_VOCAB_SIZE})",
    )
    p.add_argument(
        "--exclude-token-ids",
        default=None,
        help="comma-separated ids never drawn ('' for none; default: the special ids /v1/models lists)",
    )
    p.add_argument("--timeout", type=float, default=6 * 3600.0, help="per-request limit in s (default: %(default)s)")
    p.add_argument("--label", default=None, help="free text stored in the result (e.g. baseline, candidate)")
    p.add_argument("--save-result", default=None, metavar="FILE.json", help="write the result JSON here")
    p.add_argument(
        "--save-replay",
        default=None,
        metavar="FILE.jsonl",
        help="record each prompt's greedy output for the benchmark-only REPLAY draft (needs --temperature 0)",
    )
    p.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="ask the server to forget its cached prefixes after the warm-ups (POST /reset_prefix_cache, else "
        "SGLang's /flush_cache), so runs compared with the cache on each start cold",
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _validate(args) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if getattr(args, "prefix_len", 0) < 0:
        raise ValueError(f"--prefix-len must be >= 0, got {args.prefix_len}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if getattr(args, "save_replay", None) and args.temperature != 0:
        raise ValueError(f"--save-replay records greedy outputs: needs --temperature 0, got {args.temperature}")


async def _model_card(client: httpx.AsyncClient, model: str | None) -> tuple[str, dict]:
    """The model id to use and its /v1/models entry ({} when the server lists no such entry)."""
    try:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        cards = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        if model is None:
            raise RuntimeError(f"cannot read /v1/models to pick a model ({e}); pass --model") from e
        log.warning("cannot read /v1/models (%s); using --model %s", e, model)
        return model, {}
    if model is None:
        if not cards:
            raise RuntimeError("/v1/models lists no model; pass --model")
        return cards[0]["id"], cards[0]
    return model, next((c for c in cards if c.get("id") == model), {})


async def _reset_prefix_cache(client: httpx.AsyncClient) -> str:
    """POST /reset_prefix_cache (vLLM's, mlaserve's), else /flush_cache (SGLang's) -> the route that answered 200;
    RuntimeError naming what the server said otherwise."""
    said = []
    for route in ("/reset_prefix_cache", "/flush_cache"):
        try:
            resp = await client.post(route)
        except httpx.HTTPError as e:
            raise RuntimeError(f"--reset-prefix-cache: {route}: {type(e).__name__}: {e}") from None
        if resp.status_code == 200:
            return route
        said.append(f"{route}: HTTP {resp.status_code} {resp.text[:200]}")
    raise RuntimeError(f"--reset-prefix-cache: the server did not reset its cache ({'; '.join(said)})")


async def _scrape(client: httpx.AsyncClient) -> dict | None:
    try:
        resp = await client.get("/metrics")
        if resp.status_code != 200:
            return None
        samples = parse_prometheus(resp.text)
    except httpx.HTTPError:
        return None
    out = {k: counter(samples, suffix) for k, suffix in COUNTERS.items()}
    by_pos = counters_by_label(resp.text, PER_POSITION, "position")
    out["accepted_per_position"] = [by_pos.get(str(i), 0.0) for i in range(len(by_pos))] if by_pos else None
    return out


def _per_position_delta(before: dict | None, after: dict | None) -> list[int] | None:
    a = after.get("accepted_per_position") if after else None
    if a is None or before is None:
        return None
    b = before.get("accepted_per_position") or []
    return [int(x - (b[i] if i < len(b) else 0)) for i, x in enumerate(a)]


async def _run_requests(client, prompts, args, model, arrivals, desc: str) -> list[RequestRecord]:
    sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
    pbar = tqdm(total=len(prompts), desc=desc, disable=args.disable_tqdm)
    origin = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, origin + arrivals[i] - time.perf_counter()))
        seed = args.seed + i if args.temperature > 0 else None  # greedy needs none; sampled runs stay reproducible
        body = completion_payload(model, prompts[i].tolist(), args.output_len, args.temperature, args.ignore_eos, seed)
        async with sem:
            rec = await send_request(client, "/v1/completions", body, RequestRecord(i, len(prompts[i])), args.timeout)
        pbar.update(1)
        return rec

    try:
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    finally:
        pbar.close()


def _warnings(args, records: list[RequestRecord], agree: bool | None) -> list[str]:
    out = []
    for r in records:
        if not r.success:
            continue
        if args.ignore_eos and r.output_tokens != args.output_len:
            out.append(f"request {r.index}: {r.output_tokens} output tokens, asked for {args.output_len}")
        if r.prompt_tokens is not None and r.prompt_tokens != r.prompt_len:
            out.append(f"request {r.index}: server counted {r.prompt_tokens} prompt tokens, sent {r.prompt_len}")
        if r.event_counting == "token_ids" and r.output_tokens != r.streamed_tokens:
            out.append(f"request {r.index}: usage says {r.output_tokens} tokens, token_ids carried {r.streamed_tokens}")
    if any(r.event_counting == "text_events" for r in records if r.success):
        out.append("the server sent no token_ids: events counted as 1 token each, so event vectors are approximate")
    if agree is False:
        out.append("accepted tokens in usage and the /metrics delta disagree (other traffic on the server?)")
    return out


async def run_bench(args) -> dict:
    """The whole run; returns the result dict (the JSON schema `bench compare` reads)."""
    _validate(args)
    timeout = httpx.Timeout(None, connect=60.0)  # the per-request limit is --timeout, applied around the stream
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=timeout, limits=limits, trust_env=False) as client:
        model, card = await _model_card(client, args.model)
        vocab_src = "flag" if args.vocab_size else ("server" if card.get("vocab_size") else "default")
        vocab = int(args.vocab_size or card.get("vocab_size") or DEFAULT_VOCAB_SIZE)
        if args.exclude_token_ids is not None:
            exclude = [int(x) for x in args.exclude_token_ids.split(",") if x.strip()]
        else:
            exclude = [t for t in special_ids_from_card(card) if t < vocab]
        prefix_len = getattr(args, "prefix_len", 0)
        prompts = random_prompts(args.num_prompts, args.input_len, args.seed, vocab, exclude)
        prompts = with_shared_prefix(prompts, prefix_len, args.seed, vocab, exclude)
        if args.num_warmups:
            warm = random_prompts(args.num_warmups, args.input_len, args.seed, vocab, exclude, stream=WARMUP_STREAM)
            warm = with_shared_prefix(warm, prefix_len, args.seed, vocab, exclude, stream=WARMUP_PREFIX_STREAM)
            warm_recs = await _run_requests(client, warm, args, model, [0.0] * len(warm), "warmup")
            warm_failed = [r for r in warm_recs if not r.success]
        else:
            warm_failed = []
        reset = await _reset_prefix_cache(client) if getattr(args, "reset_prefix_cache", False) else None
        before = await _scrape(client)
        arrivals = poisson_arrivals(args.num_prompts, args.request_rate, args.seed)
        records = await _run_requests(client, prompts, args, model, arrivals, "bench")
        after = await _scrape(client)

    replay = None
    if getattr(args, "save_replay", None):
        from ..spec.replay import write_recordings

        recs = [(prompts[r.index].tolist(), r.output_token_ids) for r in records if r.success and r.output_token_ids]
        replay = {"path": args.save_replay, "count": write_recordings(args.save_replay, recs)}
    origin = min(r.start_s for r in records)
    for r in records:
        r.start_s, r.end_s = r.start_s - origin, r.end_s - origin
    reqs = [r.to_json() for r in records]
    summary = summarize_run(reqs)
    delta = None
    if before is not None and after is not None:
        delta = {k: None if after[k] is None or before[k] is None else after[k] - before[k] for k in COUNTERS}
    acc_metrics = delta["accepted_tokens"] if delta else None
    acc_usage = summary["accepted_tokens_usage"]
    agree = None if acc_metrics is None or acc_usage is None else int(acc_metrics) == acc_usage
    draft_metrics = delta["draft_tokens"] if delta else None
    steps_metrics = delta["spec_steps"] if delta else None
    per_pos_metrics = _per_position_delta(before, after)
    if per_pos_metrics is not None and steps_metrics:  # the server's own counts
        acceptance = acceptance_by_position(per_pos_metrics, int(steps_metrics))
    else:  # the responses' usage; each event after a request's first is one verify step
        acceptance = acceptance_by_position(summary["accepted_per_position_usage"], summary["event_total"])
    modes = {r.event_counting for r in records if r.success}
    warnings = _warnings(args, records, agree)
    warnings += [f"warmup request {r.index} failed: {r.error}" for r in warm_failed]
    config = {k: v for k, v in vars(args).items() if k not in ("module",)}
    if math.isinf(config["request_rate"]):
        config["request_rate"] = "inf"  # strict JSON has no Infinity
    return {
        "schema": SCHEMA,
        **provenance(),
        "label": args.label,
        "base_url": args.base_url,
        "model": model,
        "config": config,
        "vocab_size": vocab,
        "vocab_size_source": vocab_src,
        "excluded_token_ids": exclude,
        "prompts_sha256": prompts_sha256(prompts),
        "event_counting": modes.pop() if len(modes) == 1 else ("mixed" if modes else None),
        **summary,
        "accepted_tokens_metrics": int(acc_metrics) if acc_metrics is not None else None,
        "draft_tokens_metrics": int(draft_metrics) if draft_metrics is not None else None,
        "accepted_tokens_agree": agree,
        "spec_steps_metrics": int(steps_metrics) if steps_metrics is not None else None,
        "accepted_per_position_metrics": per_pos_metrics,
        **acceptance,
        "speculative": card.get("speculative"),
        "replay_recordings": replay,
        "prefix_cache_reset": reset,  # the route that reset the server's prefix cache before the run, or None
        "server_metrics": {"before": before, "after": after, "delta": delta},
        "warnings": warnings,
        "requests": reqs,
    }


def cli_main(args) -> int:
    try:
        result = asyncio.run(run_bench(args))
    except (ValueError, RuntimeError) as e:
        print(f"bench serve: {e}")
        return 2
    print(format_summary(result))
    if result.get("replay_recordings"):
        rec = result["replay_recordings"]
        print(f"saved {rec['count']} greedy outputs for the benchmark-only REPLAY draft to {rec['path']}")
    if args.save_result:
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps_result(result))
        print(f"saved {path}")
    return 0 if result["failed"] == 0 else 1
