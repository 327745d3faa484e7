"""One streamed /v1/completions request, timed on the client: the per-request record of the bench result.

An event "carries tokens" when its choice has a non-empty `token_ids` (vLLM's `return_token_ids` extension). A server
that sends no `token_ids` is counted at one token per event with non-empty text, and the record says so.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from .metrics import itls_ms, tpot_ms


@dataclass
class RequestRecord:
    index: int  # prompt order: compare matches requests by it
    prompt_len: int
    success: bool = False
    error: str | None = None
    text: str = ""
    output_token_ids: list[int] | None = None  # None when the server streamed no token_ids
    event_vector: list[int] = field(default_factory=list)  # tokens per token-carrying event, in order
    event_counting: str = "token_ids"  # or "text_events": 1 token per event with text (no token_ids sent)
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    e2el_ms: float | None = None
    tpot_ms: float | None = None
    output_tokens: int = 0  # usage.completion_tokens when sent, else sum(event_vector)
    streamed_tokens: int = 0  # sum(event_vector)
    prompt_tokens: int | None = None  # usage.*, None when not sent
    cached_tokens: int | None = None
    accepted_tokens: int | None = None
    accepted_per_position: list[int] | None = None  # [i]: verify steps that accepted draft token i + 1
    rejected_tokens: int | None = None
    finish_reason: str | None = None
    start_s: float = 0.0  # send time, seconds from the run's clock origin
    end_s: float = 0.0  # last event with choices

    def to_json(self) -> dict:
        return asdict(self)


def completion_payload(
    model: str, prompt: list[int], output_len: int, temperature: float, ignore_eos: bool, seed: int | None
) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if seed is not None:
        body["seed"] = seed
    return body


def _read_usage(rec: RequestRecord, usage: dict) -> None:
    rec.prompt_tokens = usage.get("prompt_tokens")
    if usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    details = usage.get("completion_tokens_details") or {}
    rec.accepted_tokens = details.get("accepted_prediction_tokens")
    rec.rejected_tokens = details.get("rejected_prediction_tokens")
    rec.accepted_per_position = details.get("accepted_prediction_tokens_per_position")


async def _stream(client: httpx.AsyncClient, url: str, payload: dict, rec: RequestRecord, t0: float) -> None:
    token_times: list[float] = []  # ms from send, one per token-carrying event
    last_choice = None
    got_usage = done = False
    ids: list[int] = []
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {body[:500]}")
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):  # blank separators, SSE comments
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(f"server error in stream: {chunk['error']}")
            if chunk.get("usage"):
                got_usage = True
                _read_usage(rec, chunk["usage"])
            choices = chunk.get("choices") or []
            if not choices:
                continue
            choice = choices[0]
            last_choice = now
            text = choice.get("text") or ""
            rec.text += text
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
            if "token_ids" in choice and choice["token_ids"] is not None:
                n = len(choice["token_ids"])
                ids.extend(int(t) for t in choice["token_ids"])
            else:
                rec.event_counting = "text_events"
                n = 1 if text else 0
            if n:
                rec.event_vector.append(n)
                token_times.append((now - t0) * 1000.0)
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    if not rec.event_vector:
        raise RuntimeError("stream carried no tokens")
    rec.output_token_ids = ids if rec.event_counting == "token_ids" else None
    rec.streamed_tokens = sum(rec.event_vector)
    if not got_usage or rec.output_tokens == 0:
        rec.output_tokens = rec.streamed_tokens
    rec.ttft_ms = token_times[0]
    rec.itl_ms = itls_ms(token_times)
    rec.e2el_ms = (last_choice - t0) * 1000.0
    rec.tpot_ms = tpot_ms(rec.e2el_ms, rec.ttft_ms, rec.output_tokens)
    rec.end_s = last_choice
    rec.success = True


async def send_request(
    client: httpx.AsyncClient, url: str, payload: dict, rec: RequestRecord, timeout_s: float | None
) -> RequestRecord:
    """Stream one completion into `rec`; every failure is caught and kept as `rec.error`."""
    t0 = time.perf_counter()
    rec.start_s = t0
    try:
        await asyncio.wait_for(_stream(client, url, payload, rec, t0), timeout_s)
    except asyncio.TimeoutError:
        rec.error = f"timed out after {timeout_s} s"
    except Exception as e:  # noqa: BLE001 - a failed request must not stop the run
        rec.error = f"{type(e).__name__}: {e}"
    if rec.error is not None:
        rec.success = False
        rec.end_s = time.perf_counter()
    return rec
