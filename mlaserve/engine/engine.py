"""LLMEngine: the step loop. schedule -> run -> postprocess (append tokens, detokenize, stop, free pages).

Requests are validated when added (a bad one raises ValueError naming the field and is never queued),
so one request's bad input cannot disturb the others.

Overlapped decode. In a steady decode batch the host's share of a step (postprocess: detokenize, stop checks;
schedule; input copies) would leave the GPU idle, ~0.3 ms at batch 1 and ~0.9 ms at batch 32 on M1. So when a
step is in flight in which every running request samples (decode, or its prompt's last chunk) and the next one is
certain to feed them one token each (no waiting request to admit, pages to spare; those ending by length on this
token sit it out), the engine launches that next step *before* reading the current
one back: each request gets a placeholder token, and the step's input ids are copied on the device from the
tokens the step before sampled (stream order makes that safe). Then it reads the first step's tokens, fills the
placeholders and postprocesses while the GPU runs. A request that stops on the earlier step (EOS, stop string)
was fed one more token, which is simply dropped; its pages are freed at once, as later GPU work queues behind
that step. step() still returns each step's outputs exactly once, in order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..attention.base import SeqChunk
from ..config import EngineConfig, ModelConfig, SpecConfig
from ..detokenizer import IncrementalDetokenizer
from ..distributed.tp import RankInfo
from ..layers.sampler import SamplingRow, sample
from ..tokenizer import Tokenizer
from ..types import Request, RequestStatus, SamplingParams, Usage
from .kv_pool import KVPool
from .runner import ModelRunner, resolve_dtype
from .scheduler import Scheduler, SchedulerOutput

log = logging.getLogger("mlaserve.engine")


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


PLACEHOLDER = -1  # an output token whose value is still on the device (overlapped decode)


@dataclass
class _InFlight:
    """A launched step not yet read back: its schedule, the tokens it samples (on the device) and their copies
    on the way to pinned host memory (read after `ready` fires, so a later step queued behind does not delay
    them: a plain .tolist() would wait for everything queued on the stream)."""

    out: SchedulerOutput
    tokens: torch.Tensor | None  # [sampled chunks] int64
    logprobs: torch.Tensor | None
    host: tuple | None = None  # (tokens, logprobs or None) in host memory (pinned on CUDA)
    ready: torch.cuda.Event | None = None

    def read(self) -> tuple[list[int], list[float] | None]:
        if self.tokens is None:
            return [], None
        if self.host is None:
            return self.tokens.tolist(), self.logprobs.tolist() if self.logprobs is not None else None
        if self.ready is not None:
            self.ready.synchronize()
        tok, lp = self.host
        return tok.tolist(), lp.tolist() if lp is not None else None


@dataclass
class _ReqState:
    req: Request
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    eos: frozenset[int]
    drafts: list[int] | None = None  # the proposer's tokens for the next verify step


class LLMEngine:
    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig | None = None,
        runner: ModelRunner | None = None,
        spec: SpecConfig | None = None,
        proposer=None,
        ranks: RankInfo = RankInfo(),
    ):
        cfg.validate()
        self.cfg, self.spec = cfg, spec
        self.model_config = model_cfg or ModelConfig.from_pretrained(cfg.model)
        extra = 0
        if spec is not None:
            from ..spec.build import draft_kv_page_bytes

            extra = draft_kv_page_bytes(spec, cfg.page_size, resolve_dtype(cfg.dtype, self.model_config))
        self.runner = runner or ModelRunner(cfg, self.model_config, ranks=ranks, extra_page_bytes=extra)
        self.proposer = proposer
        if spec is not None and proposer is None:
            from ..spec.build import build_proposer

            self.proposer = build_proposer(spec, self.runner)
        self.spec_k = spec.num_steps if spec is not None else 0
        self.tokenizer = Tokenizer.from_pretrained(cfg.model)
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            log.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d: positions past it were never trained",
                self.max_model_len,
                self.model_config.max_position_embeddings,
            )
        self.pool = KVPool(self.runner.num_pages, cfg.page_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.pool, decode_q_len=self.spec_k + 1)
        self.states: dict[str, _ReqState] = {}
        self.generator = torch.Generator(device=self.runner.device).manual_seed(cfg.seed)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        if self.runner.device.type == "cuda" and not cfg.enforce_eager:
            self.runner.capture_graphs(self.spec_k + 1, self.max_model_len)
            if hasattr(self.proposer, "capture_graphs"):  # the draft runs on rank 0 only: no collectives inside
                self.proposer.capture_graphs(cfg.max_num_seqs, self.runner.graphs.max_pages)
        # overlapped decode (see the module docstring): single rank, no speculation
        self.overlap = not (self.spec_k or ranks.world_size > 1 or cfg.disable_overlap_schedule)
        self._inflight: _InFlight | None = None
        self.num_steps = self.num_overlapped_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.spec_steps = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_accepted_per_position = [0] * self.spec_k  # [i]: verify steps that accepted draft token i + 1
        self._accept_log = [0, 0]  # accepted, steps since the last log line

    # ---- requests ------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; nothing is queued."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        V = self.model_config.vocab_size
        for i, t in enumerate(prompt_token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V:
                raise ValueError(f"prompt: token id {t!r} at index {i} is outside the vocabulary [0, {V})")
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens leave no room to generate within max_model_len {self.max_model_len}")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: {params.max_tokens} plus the prompt's {n} tokens exceeds max_model_len "
                f"{self.max_model_len}"
            )
        if self.spec_k and params.logprobs is not None:
            raise ValueError("logprobs: not supported together with speculative decoding")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; this model has none")
        if self.pool.pages_for(n + 1) > self.pool.num_pages:
            raise ValueError(f"prompt: {n} tokens need more KV pages than the cache holds ({self.pool.num_pages})")
        if self.scheduler.num_unfinished >= self.cfg.max_queue_len:
            raise OverflowError(
                f"the engine already holds {self.scheduler.num_unfinished} requests "
                f"(max_queue_len {self.cfg.max_queue_len})"
            )

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        self.validate(prompt_token_ids, params)
        req = Request(list(prompt_token_ids), params, arrival=time.monotonic())
        if request_id is not None:
            if request_id in self.states:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            req.request_id = request_id
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, stop=params.stop)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        self.states[req.request_id] = _ReqState(req, detok, gen, eos)
        self.scheduler.add(req)
        return req.request_id

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now and free its pages; False if it is unknown or already done."""
        st = self.states.pop(request_id, None)
        if st is None:
            return False
        if st.req.output_token_ids[-1:] == [PLACEHOLDER]:  # fed to an in-flight step, never read back
            st.req.output_token_ids.pop()
        self.scheduler.finish(st.req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        if self._inflight is not None:
            return self._overlapped_step()
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        if self.spec_k:
            decode = [
                SeqChunk(
                    self._seq_chunk(c.req, 1, True).token_ids + self.states[c.req.request_id].drafts,
                    c.req.num_computed_tokens,
                    c.req.pages,
                    "all",
                )
                for c in out.decode
            ]
        else:
            decode = [self._seq_chunk(c.req, c.num_new, c.sample) for c in out.decode]
        prefill = [self._seq_chunk(c.req, c.num_new, c.sample) for c in out.prefill]
        logits, aux, greedy = self.runner.execute(decode, prefill)
        self.num_steps += 1
        if self.spec_k:
            return self._postprocess_spec(out, logits, aux)
        step = self._sample(out, logits, greedy)
        if self.overlap and all(c.sample for c in out.prefill):  # decode next for every request
            self._inflight = step
            return self._overlapped_step()
        return self._postprocess(step)

    def _overlapped_step(self) -> list[StepOutput]:
        """Launch the next decode step if it is certain, then read back and postprocess the one in flight."""
        cur, self._inflight = self._inflight, None
        ending = self._next_decode_is_certain(cur.out)
        if ending is not None:
            sampled = [c for c in cur.out.chunks if c.sample]  # the order of cur.tokens
            rows = {id(c.req): j for j, c in enumerate(sampled)}
            for c in sampled:  # the token cur samples: its value stays on the device for now
                c.req.output_token_ids.append(PLACEHOLDER)
                c.req.num_computed_tokens += c.num_new
            # requests this token ends by length sit the next step out; postprocess finishes them
            out = self.scheduler.schedule(hold=frozenset(r.request_id for r in ending))
            assert not out.prefill and not out.preempted and all(id(c.req) in rows for c in out.decode)
            if out.decode:
                decode = [self._seq_chunk(c.req, c.num_new, c.sample) for c in out.decode]
                idx = [rows[id(c.req)] for c in out.decode]
                src = (
                    cur.tokens
                    if idx == list(range(len(sampled)))
                    else cur.tokens[torch.tensor(idx).to(cur.tokens.device, non_blocking=True)]
                )  # no stream sync
                logits, _, greedy = self.runner.execute(decode, [], decode_tokens=src)
                self.num_steps += 1
                self.num_overlapped_steps += 1
                self._inflight = self._sample(out, logits, greedy)
        return self._postprocess(cur, filled=ending is not None)

    def _next_decode_is_certain(self, out: SchedulerOutput) -> list[Request] | None:
        """None, or the requests whose next token (sampled by `out`) ends them by length, when the next
        schedule is certain whatever `out` samples: every running request samples in `out` (a decode token, or
        the last chunk of its prompt) and so decodes one token next, no waiting request would be admitted, and
        the next pages are free without preempting anyone."""
        sch = self.scheduler
        sampled = [c for c in out.chunks if c.sample]
        if not sampled or len(sampled) != len(out.chunks) or len(sampled) != len(sch.running):
            return None
        ending, pages = [], 0
        decoding = {id(c) for c in out.decode}
        for c in sampled:
            req = c.req
            if (
                req.status != RequestStatus.RUNNING
                or req.request_id not in self.states
                or (id(c) in decoding and c.num_new != 1)
            ):
                return None
            if self._at_length(req, 1):
                ending.append(req)
            else:
                pages += max(0, self.pool.pages_for(req.num_tokens + 1) - len(req.pages))
        if sch.waiting and len(sch.running) - len(ending) < self.cfg.max_num_seqs:
            return None  # a waiting request gets admitted: schedule after reading this step back
        if pages > self.pool.num_free or len(sampled) > self.cfg.max_num_batched_tokens:
            return None
        return ending

    def _seq_chunk(self, req: Request, n: int, sample_: bool) -> SeqChunk:
        start = req.num_computed_tokens
        return SeqChunk(req.tokens(start, start + n), start, req.pages, "last" if sample_ else "none")

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, greedy=None) -> _InFlight:
        """Queue the sampling of the chunks that asked for it (tokens [n] int64, logprobs [n] or None, on the
        device) and, on CUDA, their copy to pinned host memory: no host sync here. greedy: the decode graph's own
        arg-max of these rows (GreedyTokens), which a step of greedy rows without logprobs takes as it is."""
        sampled = [c for c in out.chunks if c.sample]
        if not sampled:
            return _InFlight(out, None, None)
        want_lp = any(c.req.params.logprobs is not None for c in sampled)
        if (
            greedy is not None
            and len(sampled) == len(greedy.device)
            and not want_lp
            and all(c.req.params.greedy for c in sampled)
        ):
            step = _InFlight(out, greedy.device, None, host=(greedy.host, None))
            if greedy.device.is_cuda:  # the graph wrote the host row itself: only an event to wait on
                step.ready = torch.cuda.Event()
                step.ready.record()
            return step
        rows = [SamplingRow(c.req.params, self.states[c.req.request_id].generator) for c in sampled]
        step = _InFlight(out, *sample(logits, rows, self.generator, want_lp))
        if step.tokens.is_cuda:
            step.host = tuple(
                None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in (step.tokens, step.logprobs)
            )
            step.ready = torch.cuda.Event()
            step.ready.record()
        return step

    def _postprocess(self, step: _InFlight, filled: bool = False) -> list[StepOutput]:
        """Read the step's tokens back (its one host sync) and append them. filled: the requests already hold a
        PLACEHOLDER for this token and count its input as computed (the next step is in flight)."""
        out = step.out
        tokens, logprobs = step.read()
        results = []
        for c in out.chunks:
            req = c.req
            if req.status == RequestStatus.FINISHED:  # stopped on the step before, or aborted: drop its token
                continue
            if not filled:
                req.num_computed_tokens += c.num_new
            self.scheduler.commit_pages(req)
        for j, c in enumerate(c for c in out.chunks if c.sample):
            if c.req.status == RequestStatus.FINISHED:
                continue
            lp = [logprobs[j]] if logprobs is not None and c.req.params.logprobs is not None else None
            results.append(self._append(c.req, [tokens[j]], lp, filled))
        return results

    def _postprocess_spec(self, out: SchedulerOutput, logits: torch.Tensor, aux: torch.Tensor) -> list[StepOutput]:
        """Verify each decode request's drafts, sample finished prefills, then let the draft propose again."""
        from ..spec.eagle3 import DraftChunk
        from ..spec.verify import count_accepted, verify_greedy, verify_sampled

        K, N = self.spec_k, self.spec_k + 1
        B = len(out.decode)
        emitted: list[list[int]] = []
        if B:
            dec = logits[: B * N].view(B, N, -1)
            drafts = [self.states[c.req.request_id].drafts for c in out.decode]
            y, acc = verify_greedy(dec, torch.tensor(drafts, device=dec.device))
            y, acc = y.tolist(), acc.tolist()
            for b, c in enumerate(out.decode):
                if c.req.params.greedy:
                    emitted.append(y[b][: acc[b] + 1])
                else:
                    st = self.states[c.req.request_id]
                    emitted.append(
                        verify_sampled(dec[b], drafts[b], SamplingRow(c.req.params, st.generator), self.generator)
                    )
        sampled = [c for c in out.prefill if c.sample]
        rows = [SamplingRow(c.req.params, self.states[c.req.request_id].generator) for c in sampled]
        first = sample(logits[B * N :], rows, self.generator)[0].tolist() if sampled else []

        results, chunks, row = [], [], 0
        for b, c in enumerate(out.decode):
            req, toks = c.req, emitted[b]
            start = req.num_computed_tokens
            req.num_computed_tokens += len(toks)  # the fed last token + the accepted drafts now have KV
            self.scheduler.commit_pages(req)
            ev = self._append(req, toks, None)
            req.spec_steps += 1
            req.spec_draft_tokens += K
            req.spec_accepted_tokens += len(ev.new_token_ids) - 1  # accepted drafts actually emitted
            count_accepted(req.spec_accepted_per_position, len(ev.new_token_ids) - 1, K)
            count_accepted(self.spec_accepted_per_position, len(ev.new_token_ids) - 1, K)
            self.spec_steps += 1
            self.spec_draft_tokens += K
            self.spec_accepted_tokens += len(ev.new_token_ids) - 1
            ev.usage = self.usage(req)
            results.append(ev)
            if not ev.finished:
                chunks.append(DraftChunk(req, toks, start, _rows(aux, row, N), propose=True, verify=True))
            row += N
        it = iter(first)
        for c in out.prefill:
            req, start = c.req, c.req.num_computed_tokens
            req.num_computed_tokens += c.num_new
            self.scheduler.commit_pages(req)
            finished = False
            if c.sample:
                ev = self._append(req, [next(it)], None)
                results.append(ev)
                finished = ev.finished
            if not finished:
                nxt = req.tokens(start + 1, start + c.num_new + 1)
                chunks.append(DraftChunk(req, nxt, start, _rows(aux, row, c.num_new), propose=c.sample))
            row += c.num_new
        for rid, d in self.proposer.propose(chunks).items():
            self.states[rid].drafts = d
        self._log_acceptance(B, sum(len(e) - 1 for e in emitted))
        return results

    def _log_acceptance(self, steps: int, accepted: int) -> None:
        self._accept_log[0] += accepted
        self._accept_log[1] += steps
        if self._accept_log[1] >= 1000:
            a, n = self._accept_log
            log.info(
                "speculative decoding: mean accept length %.3f (%d verify steps; %.1f%% of drafts accepted)",
                1 + a / n,
                n,
                100 * a / (n * self.spec_k),
            )
            self._accept_log = [0, 0]

    def _append(
        self, req: Request, new_tokens: list[int], logprobs: list[float] | None, filled: bool = False
    ) -> StepOutput:
        """Append tokens one by one, stopping at the first stop condition; emits one event. filled: one token,
        whose PLACEHOLDER is already the last output token."""
        st = self.states[req.request_id]
        p = req.params
        added, text, reason, stop_reason = [], "", None, None
        for t in new_tokens:
            if filled:
                req.output_token_ids[-1] = t
            else:
                req.output_token_ids.append(t)
            added.append(t)
            delta, stop_str = st.detok.step([t])
            text += delta
            if stop_str is not None:
                reason, stop_reason = "stop", stop_str
            elif t in p.stop_token_ids:
                reason, stop_reason = "stop", t
            elif t in st.eos:
                reason = "stop"
            elif self._at_length(req):
                reason = "length"
            if reason:
                break
        if reason and not isinstance(stop_reason, str):
            text += st.detok.flush()[0]  # release text held back for a possible stop string or half character
        if logprobs is not None:
            req.output_logprobs += logprobs[: len(added)]
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
        )

    def _at_length(self, req: Request, more: int = 0) -> bool:
        """The request's output reaches max_tokens, or its length max_model_len, once `more` tokens are added."""
        p = req.params
        return (
            p.max_tokens is not None and len(req.output_token_ids) + more >= p.max_tokens
        ) or req.num_tokens + more >= self.max_model_len

    def usage(self, req: Request) -> Usage:
        return Usage(
            len(req.prompt_token_ids),
            len(req.output_token_ids),
            req.num_cached_tokens,
            req.spec_draft_tokens,
            req.spec_accepted_tokens,
            tuple(req.spec_accepted_per_position),
        )

    def stats(self) -> dict:
        return {
            "spec_steps": self.spec_steps,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_accepted_per_position": list(self.spec_accepted_per_position),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_used": self.pool.num_used,
            "kv_pages_total": self.pool.num_pages,
            "prefix_cache_queries": self.pool.queries,
            "prefix_cache_hits": self.pool.hits,
            "steps": self.num_steps,
            "overlapped_steps": self.num_overlapped_steps,
            "generated_tokens": self.num_generated_tokens,
        }


def _rows(t: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    return None if t is None else t[start : start + n]
