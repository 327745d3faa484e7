"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step computes, for every scheduled request, the next `num_new` tokens of its token list
(prompt + generated so far). A request with one token left is decoding: it is fed its last token
(plus its speculative draft tokens when verifying). When a step reaches the end of a request's
tokens, its last position is sampled. Running requests are served before waiting ones; when pages run
out, the newest running request is preempted (its pages freed, its KV recomputed later).

Admission is first come, first served, with a bounded skip-ahead: a waiting request whose first chunk finds too few
free pages stays at its place while later requests that fit are admitted past it, until SKIP_AHEAD_LIMIT of them
have been; from then on admission waits for it, so running requests drain and free its pages. A request that
cannot fit even with the whole cache to itself (the engine refuses those before queueing) is finished by length
(`cannot_fit`), never recomputed in a loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..types import Request, RequestStatus
from .kv_pool import KVPool

# How many later requests may be admitted past a waiting request that lacks pages before admission waits for it:
# enough that a long prompt does not hold short ones back, few enough that it is never starved by them.
SKIP_AHEAD_LIMIT = 32


@dataclass
class ScheduledChunk:
    req: Request
    num_new: int  # tokens fed this step (for a verifying decode: 1 + drafts)
    sample: bool  # this step reaches the end of the request's tokens: sample its last position(s)


@dataclass
class SchedulerOutput:
    decode: list[ScheduledChunk] = field(default_factory=list)
    prefill: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: KVPool, decode_q_len: int = 1):
        self.cfg, self.pool = cfg, pool
        self.decode_q_len = decode_q_len  # 1, or N = K+1 when verifying K draft tokens
        self.tail_decodes = decode_q_len == 1 and not cfg.deterministic
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.committed_pages: dict[str, int] = {}  # request id -> pages registered in the prefix cache
        self.num_preemptions = 0
        self.skip_ahead_limit = SKIP_AHEAD_LIMIT
        self.bypassed: dict[str, int] = {}  # waiting request id -> later requests admitted past it
        self.cannot_fit: list[Request] = []  # finished by length here: too long for the whole cache (engine emits)

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self.pool.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        req.pages += pages
        return True

    def _release(self, req: Request) -> None:
        self.pool.free(req.pages)
        req.pages = []
        self.committed_pages.pop(req.request_id, None)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        # Pages past the fed tokens, reserved so a verify step's N slots always fit.
        overshoot = self.decode_q_len - 1

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            # a prompt's last token fed alone (its last chunk, or what a prefix-cache hit leaves) rides a decode
            # row, and the decode graph, on the plain path; with speculation or in deterministic mode it is a
            # prefill row like the rest of its prompt: a verify needs drafts the prompt has not got yet, and the
            # mode takes the first output token from one path whatever the chunking or the cache
            decoding = remaining == 1 and (len(req.output_token_ids) > 0 or self.tail_decodes)
            n = self.decode_q_len if decoding else min(remaining, budget, self.cfg.chunked_prefill_size)
            if n > budget:
                break
            sample = decoding or req.num_computed_tokens + n == req.num_tokens
            # A sampling step is followed by draft steps that write up to num_steps positions further.
            while not self._grow(req, req.num_computed_tokens + n + (overshoot if sample else 0)):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status == RequestStatus.WAITING:  # preempted itself: nothing after it is left
                if not self.running:  # it had the whole cache and still did not fit: it never will
                    self._finish_cannot_fit(req)
                break
            chunk = ScheduledChunk(req, n, sample=sample)
            (out.decode if decoding else out.prefill).append(chunk)
            budget -= n
            i += 1
        if not out.preempted:
            self._admit(out, budget, overshoot)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, overshoot: int) -> None:
        """Admit waiting requests in order under the budget; those that must wait keep their place (module doc)."""
        kept = []  # requests that stay waiting, in order
        short = []  # of those, the ones short of pages
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting.popleft()
            if self._fork_waits(req):  # its sibling has not computed the shared pages yet
                kept.append(req)
                continue
            tokens = req.all_token_ids
            cached = self._cached_prefix(req, tokens)
            num_cached = len(cached) * self.pool.page_size
            n = min(len(tokens) - num_cached, budget, self.cfg.chunked_prefill_size)
            sample = num_cached + n == len(tokens)
            req.pages = list(cached)  # _grow appends to req.pages
            if not self._grow(req, num_cached + n + (overshoot if sample else 0)):
                self._release(req)
                if not self.running:  # the whole cache is free and its first chunk does not fit: it never will
                    self._finish_cannot_fit(req)
                    continue
                kept.append(req)
                short.append(req)
                if (
                    self.bypassed.get(req.request_id, 0) >= self.skip_ahead_limit
                    or len(short) >= self.skip_ahead_limit  # bounds the scan of a long queue
                    or self.pool.num_free == 0
                ):
                    break  # FCFS from here: nobody else is admitted past it
                continue
            self.pool.record_lookup(len(tokens), num_cached)
            self.bypassed.pop(req.request_id, None)
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            self.committed_pages[req.request_id] = len(cached)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.prefill.append(ScheduledChunk(req, n, sample=sample))
            budget -= n
            for k in short:  # admitted past them
                self.bypassed[k.request_id] = self.bypassed.get(k.request_id, 0) + 1
            if any(self.bypassed[k.request_id] >= self.skip_ahead_limit for k in short):
                break
        self.waiting.extendleft(reversed(kept))

    def _finish_cannot_fit(self, req: Request) -> None:
        self.finish(req, "length")
        self.cannot_fit.append(req)

    def _shared_pages(self, req: Request) -> int:
        """Full pages of req's prompt a fork can take from its sibling (the last prompt token is always computed)."""
        return (len(req.prompt_token_ids) - 1) // self.pool.page_size

    def _fork_waits(self, req: Request) -> bool:
        """A fork waits while its sibling (running or queued) has not yet computed the pages they share."""
        src, need = req.fork_of, self._shared_pages(req) * self.pool.page_size
        if src is None or src.status == RequestStatus.FINISHED or need == 0:
            return False
        return src.status != RequestStatus.RUNNING or src.num_computed_tokens < need

    def _cached_prefix(self, req: Request, tokens: list[int]) -> list[int]:
        """The pages of req's computed prefix, referenced for it: its sibling's prompt pages (a fork), or the prefix
        cache's. None for a request that wants prompt logprobs: every prompt position must be computed."""
        if req.params.prompt_logprobs is not None:
            return []
        cached = self.pool.match_prefix(tokens)
        src = req.fork_of
        if src is not None and src.status == RequestStatus.RUNNING and req.num_preemptions == 0:
            k = min(self._shared_pages(req), src.num_computed_tokens // self.pool.page_size, len(src.pages))
            if k > len(cached):
                self.pool.free(cached)
                cached = self.pool.share(src.pages[:k])
        return cached

    def schedule_decode(self, reqs: list[Request]) -> SchedulerOutput:
        """One decode token for each of `reqs` (running requests, in order), planned while the step before is in
        flight: each is fed the token that step samples, which sits at position num_tokens and is not in its token
        list yet (overlapped decode, engine/loop.py). The caller checked that the pages fit: nobody is preempted
        and nobody admitted."""
        out = SchedulerOutput()
        for req in reqs:
            if not self._grow(req, req.num_tokens + 1):
                raise RuntimeError(f"{req.request_id}: no KV page for an overlapped decode step")
            out.decode.append(ScheduledChunk(req, 1, sample=True))
        return out

    def schedule_verify(self, reqs: list[Request], num_new: int, reserve: int) -> SchedulerOutput:
        """A verify of num_new tokens for each of `reqs` (running requests, in order), planned while the verify
        before is in flight: how many tokens that one accepts is not known yet, so each request gets the pages of
        `reserve` tokens past its num_computed_tokens, the most it can need (speculative overlap,
        engine/spec_loop.py). The caller checked that the pages fit: nobody is preempted and nobody admitted."""
        out = SchedulerOutput()
        for req in reqs:
            if not self._grow(req, req.num_computed_tokens + reserve):
                raise RuntimeError(f"{req.request_id}: no KV page for an overlapped verify step")
            out.decode.append(ScheduledChunk(req, num_new, sample=True))
        return out

    def commit_pages(self, req: Request) -> None:
        """Register the request's newly full, computed pages in the prefix cache."""
        done = self.committed_pages.get(req.request_id, 0)
        if (
            not self.pool.enable_prefix_caching
            or min(req.num_computed_tokens, req.num_tokens) // self.pool.page_size <= done
        ):
            return  # no page filled up this step: skip building the token list
        self.committed_pages[req.request_id] = self.pool.commit(
            req.all_token_ids, req.pages, req.num_computed_tokens, done
        )

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Free a running or waiting request's pages now and mark it finished."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        self.bypassed.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
