"""After a step's tokens are read back: append them to their requests, detokenize, check stop conditions, register
full pages in the prefix cache, finish requests (freeing their pages), and emit one StepOutput per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..detokenizer import IncrementalDetokenizer
from ..types import Request, RequestStatus, Usage
from .grammar import GrammarState
from .scheduler import Scheduler, SchedulerOutput


@dataclass
class StepOutput:
    """What one step produced for one request: the tokens and text it added (one streamed event)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    new_logprobs: list[float] | None
    usage: Usage
    new_top_logprobs: list[dict[int, float]] | None = None  # per new token: id -> logprob (params.logprobs > 0)
    index: int = 0  # the choice of its request (n > 1: engine/parallel.py)
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # params.prompt_logprobs: on the first event


@dataclass
class ReqState:
    """The engine's per-request state beside the scheduler's Request."""

    req: Request
    detok: IncrementalDetokenizer
    generator: torch.Generator | None  # the request's own (seeded) sampling generator
    eos: frozenset[int]
    drafts: list[int] | None = None  # speculative decoding: the proposer's tokens for the next verify step
    cache: dict = field(default_factory=dict)  # the sampler's per-request tensors (logits_process.SamplingRow)
    grammar: GrammarState | None = None  # structured output: the request's matcher (grammar.py)


class Postprocessor:
    def __init__(self, scheduler: Scheduler, states: dict[str, ReqState], max_model_len: int):
        self.scheduler, self.states, self.max_model_len = scheduler, states, max_model_len
        self.num_generated_tokens = 0

    def commit(self, out: SchedulerOutput) -> None:
        """The step's fed tokens now have KV: count them computed and register newly full pages. Requests that
        finished meanwhile (stopped on the step before, or aborted) are skipped: their pages are gone."""
        for c in out.chunks:
            if c.req.status == RequestStatus.FINISHED:
                continue
            c.req.num_computed_tokens += c.num_new
            self.scheduler.commit_pages(c.req)

    def sampled(
        self, out: SchedulerOutput, tokens: list[int], logprobs: list[float] | None, top: tuple | None = None
    ) -> list[StepOutput]:
        """Append the step's sampled tokens (one per sampling chunk, in chunk order) -> one event per request.
        top: (ids [n][k], logprobs [n][k]) of the rows' top alternatives, k the step's largest params.logprobs."""
        results = []
        for j, c in enumerate(c for c in out.chunks if c.sample):
            if c.req.status == RequestStatus.FINISHED:  # stopped on the step before, or aborted: drop its token
                continue
            p = c.req.params
            lp = [logprobs[j]] if logprobs is not None and (p.logprobs is not None or c.req.track_logprob) else None
            tops = None
            if p.logprobs is not None:
                k = p.logprobs
                tops = [dict(zip(top[0][j][:k], top[1][j][:k])) if k else {}]
            results.append(self.append(c.req, [tokens[j]], lp, tops))
        return results

    def append(
        self,
        req: Request,
        new_tokens: list[int],
        logprobs: list[float] | None,
        top: list[dict[int, float]] | None = None,
    ) -> StepOutput:
        """Append tokens one by one, stopping at the first stop condition; emits one event."""
        st = self.states[req.request_id]
        p = req.params
        prompt_lps = None
        if p.prompt_logprobs is not None and not req.output_token_ids:  # the first event carries them
            prompt_lps = [None] + [req.prompt_logprobs.get(i) for i in range(1, len(req.prompt_token_ids))]
        added, text, reason, stop_reason = [], "", None, None
        for t in new_tokens:
            req.output_token_ids.append(t)
            added.append(t)
            if t in p.stop_token_ids:  # a stop token's own text is not output (vLLM)
                reason, stop_reason = "stop", t
                break
            if t in st.eos:
                reason = "stop"
                break
            delta, stop_str = st.detok.step([t])
            text += delta
            if st.grammar is not None and (not st.grammar.accept(t) or st.grammar.terminated):
                # terminated: the grammar is complete and took a stop token; a refused token cannot be sampled
                # (the mask allows only what the matcher accepts), and ends the request rather than break it
                reason = "stop"
                if t in p.stop_token_ids:
                    stop_reason = t
                break
            if stop_str is not None:
                reason, stop_reason = "stop", stop_str
            elif self.at_length(req):
                reason = "length"
            if reason:
                break
        if reason and not isinstance(stop_reason, str):
            text += st.detok.flush()[0]  # release text held back for a possible stop string or half character
        if logprobs is not None:
            req.output_logprobs += logprobs[: len(added)]
            req.cumulative_logprob += sum(logprobs[: len(added)])
        if top is not None:
            req.output_top_logprobs += top[: len(added)]
        self.num_generated_tokens += len(added)
        if reason:
            self.scheduler.finish(req, reason, stop_reason)
            del self.states[req.request_id]
        return StepOutput(
            req.request_id,
            added,
            text,
            reason is not None,
            reason,
            stop_reason,
            logprobs[: len(added)] if logprobs is not None else None,
            self.usage(req),
            top[: len(added)] if top is not None else None,
            cumulative_logprob=req.cumulative_logprob if logprobs is not None else None,
            prompt_logprobs=prompt_lps,
        )

    def at_length(self, req: Request, more: int = 0) -> bool:
        """The request's output reaches max_tokens, or its length max_model_len, once `more` tokens are added."""
        p = req.params
        return (
            p.max_tokens is not None and len(req.output_token_ids) + more >= p.max_tokens
        ) or req.num_tokens + more >= self.max_model_len

    @staticmethod
    def usage(req: Request) -> Usage:
        return Usage(
            len(req.prompt_token_ids),
            len(req.output_token_ids),
            req.num_cached_tokens,
            req.spec_draft_tokens,
            req.spec_accepted_tokens,
            tuple(req.spec_accepted_per_position),
        )
