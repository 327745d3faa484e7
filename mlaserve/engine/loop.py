"""The step loops: one per mode, each `step()` returning one step's events.

    Loop.step         schedule -> launch -> process                                   (plain)
    OverlapLoop.step  launch step i+1 from step i's device outputs, then process step i   (overlapped)
    SpecLoop.step     schedule -> launch (verify) -> process (accept, propose)         (speculative, spec_loop.py)

`launch` queues a step on the device and returns it unread; `process` reads its tokens back (the step's one host
sync) and postprocesses them. Request state only ever holds tokens that were read back.

Overlapped decode. In a steady decode batch the host's share of a step (postprocess: detokenize, stop checks;
schedule; input copies) would leave the GPU idle. So while step i is in flight, `launch_next` launches step i+1
first when its schedule is certain whatever step i samples: every running request samples in step i (decode, or its
prompt's last chunk), no waiting request would be admitted, and the pages fit. Step i+1 feeds each request the
token step i sampled, on the device (stream order makes that safe; its position, num_tokens, is known on the host).
Requests that step i's token ends by length sit step i+1 out; one that step i ends by EOS or a stop string was fed
one more token, which process() drops (its pages are freed at once: later GPU work queues behind step i+1). Then
step i is read back and postprocessed while the GPU runs step i+1.

A mode overlaps by giving `launch_next`: a verify step (SpecLoop) fills step i+1 from step i's accepted tokens
and new drafts on the device, its positions moved there by the accepted counts (spec_loop.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.base import SeqChunk
from ..layers.sampler import SamplingRow, sample, top_logprobs
from ..types import Request, RequestStatus
from .postprocess import StepOutput
from .prompt_logprobs import prompt_logprobs
from .scheduler import SchedulerOutput


def seq_chunk(req: Request, n: int, sample_: bool) -> SeqChunk:
    """The runner's view of a scheduled chunk: the request's next n tokens after those computed."""
    start = req.num_computed_tokens
    return SeqChunk(req.tokens(start, start + n), start, req.pages, "last" if sample_ else "none")


@dataclass
class Launched:
    """A launched step not yet read back: its schedule, the tokens it samples (on the device) and their copies
    on the way to pinned host memory (read after `ready` fires, so a later step queued behind does not delay
    them: a plain .tolist() would wait for everything queued on the stream)."""

    out: SchedulerOutput
    tokens: torch.Tensor | None  # [sampled chunks] int64
    logprobs: torch.Tensor | None
    host: tuple | None = None  # (tokens, logprobs or None[, top ids, top logprobs]) in host memory (pinned on CUDA)
    ready: torch.cuda.Event | None = None
    top: tuple | None = None  # (ids [sampled chunks, k], logprobs [sampled chunks, k]): the top alternatives

    def read(self) -> tuple[list[int], list[float] | None, tuple | None]:
        """-> (tokens, their logprobs or None, (top ids, top logprobs) as nested lists or None)."""
        if self.tokens is None:
            return [], None, None
        if self.host is None:
            ts = (self.tokens, self.logprobs, *(self.top or ()))
        else:
            if self.ready is not None:
                self.ready.synchronize()
            ts = self.host
        tok, lp, *top = (None if t is None else t.tolist() for t in ts)
        return tok, lp, tuple(top) if top else None


class Loop:
    """Plain decode and chunked prefill: each step samples the tokens of the chunks that reach a request's end."""

    def __init__(self, engine):
        self.cfg, self.scheduler, self.runner = engine.cfg, engine.scheduler, engine.runner
        self.post, self.states, self.generator = engine.post, engine.states, engine.generator
        self.num_steps = 0
        self.num_overlapped_steps = 0

    @property
    def pending(self) -> bool:
        """A launched step is still to be read back."""
        return False

    def step(self) -> list[StepOutput]:
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        return self.process(self.launch(out))

    def launch(self, out: SchedulerOutput, decode_tokens: torch.Tensor | None = None) -> Launched:
        """Run the step's forward and queue its sampling; no host sync. decode_tokens [len(out.decode)] on the
        device: the decode chunks are fed the tokens the step in flight samples (launch_next)."""
        if decode_tokens is None:
            decode = [seq_chunk(c.req, c.num_new, c.sample) for c in out.decode]
        else:  # each at position num_tokens, its id on the device
            decode = [SeqChunk([0], c.req.num_tokens, c.req.pages, "last") for c in out.decode]
        prefill = [seq_chunk(c.req, c.num_new, c.sample) for c in out.prefill]
        for c, ch in zip(out.prefill, prefill):
            if c.req.params.prompt_logprobs is not None and ch.num_cached < len(c.req.prompt_token_ids):
                ch.need_logits = "all"  # every prompt position's logits (prompt_logprobs.py)
        logits, _, greedy = self.runner.execute(decode, prefill, decode_tokens=decode_tokens, suffix=True)
        self.num_steps += 1
        if any(ch.need_logits == "all" for ch in prefill):
            logits = prompt_logprobs(out.prefill, prefill, logits, len(decode))
        return self.sample(out, logits, greedy, pending=decode_tokens)

    def sample(self, out: SchedulerOutput, logits: torch.Tensor, greedy=None, pending=None) -> Launched:
        """Queue the sampling of the chunks that asked for it (tokens [n] int64, logprobs [n] or None, on the
        device) and, on CUDA, their copy to pinned host memory: no host sync here. greedy: the decode graph's own
        arg-max of these rows (GreedyTokens), which a step of greedy rows without logprobs or logits processors
        takes as it is. pending [n] or None: the tokens the step in flight feeds these rows (overlapped decode)."""
        sampled = [c for c in out.chunks if c.sample]
        if not sampled:
            return Launched(out, None, None)
        want_lp = any(c.req.params.logprobs is not None or c.req.track_logprob for c in sampled)
        rows = [self._row(c.req) for c in sampled]
        if (
            greedy is not None
            and len(sampled) == len(greedy.device)
            and not want_lp
            and all(c.req.params.greedy and not r.active(pending is not None) for c, r in zip(sampled, rows))
        ):
            step = Launched(out, greedy.device, None, host=(greedy.host, None))
            if greedy.device.is_cuda:  # the graph wrote the host row itself: only an event to wait on
                step.ready = torch.cuda.Event()
                step.ready.record()
            return step
        step = Launched(out, *sample(logits, rows, self.generator, want_lp, self.runner.kernels.pdl, pending))
        k = max((c.req.params.logprobs or 0 for c in sampled), default=0)
        if k:
            step.top = top_logprobs(logits, k)
        if step.tokens.is_cuda:
            step.host = tuple(
                None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in (step.tokens, step.logprobs, *(step.top or ()))
            )
            step.ready = torch.cuda.Event()
            step.ready.record()
        return step

    def _row(self, req: Request) -> SamplingRow:
        st = self.states[req.request_id]
        if not req.params.processes_logits:
            return SamplingRow(req.params, st.generator)
        stop = st.eos | frozenset(req.params.stop_token_ids)
        return SamplingRow(
            req.params, st.generator, req.prompt_token_ids, req.output_token_ids, stop, st.cache, st.grammar
        )

    def process(self, step: Launched) -> list[StepOutput]:
        """Read the step's tokens back (its one host sync) and postprocess them."""
        tokens, logprobs, top = step.read()
        self.post.commit(step.out)
        return self.post.sampled(step.out, tokens, logprobs, top)

    def launch_next(self, cur: Launched) -> Launched | None:
        """Launch the step after `cur` from cur's device tokens, if its schedule is certain; else None."""
        reqs = self.next_decode(cur.out)
        if not reqs:
            return None
        out = self.scheduler.schedule_decode(reqs)
        sampled = [c.req for c in cur.out.chunks if c.sample]  # the order of cur.tokens
        row = {id(r): j for j, r in enumerate(sampled)}
        idx = [row[id(r)] for r in reqs]
        ids = (
            cur.tokens
            if idx == list(range(len(sampled)))
            else cur.tokens[torch.tensor(idx).to(cur.tokens.device, non_blocking=True)]
        )  # no stream sync
        return self.launch(out, decode_tokens=ids)

    def next_decode(self, out: SchedulerOutput) -> list[Request] | None:
        """The requests that decode after `out`, in the scheduler's order, when that schedule is certain whatever
        `out` samples: every running request samples in `out` (a decode token, or the last chunk of its prompt)
        and so decodes one token next, no waiting request would be admitted, and the next pages are free without
        preempting anyone. Requests whose token from `out` ends them by length sit it out. None: not certain."""
        sch, pool = self.scheduler, self.scheduler.pool
        sampled = [c for c in out.chunks if c.sample]
        if not sampled or len(sampled) != len(out.chunks) or len(sampled) != len(sch.running):
            return None
        ending, pages = set(), 0
        decoding = {id(c) for c in out.decode}
        for c in sampled:
            req = c.req
            if (
                req.status != RequestStatus.RUNNING
                or req.request_id not in self.states
                or (id(c) in decoding and c.num_new != 1)
                or self.states[req.request_id].grammar is not None  # its mask needs the token `out` samples
                or req.params.bad_words  # so do its bans (which tokens end the output)
            ):
                return None
            if self.post.at_length(req, 1):
                ending.add(id(req))
            else:
                pages += max(0, pool.pages_for(req.num_tokens + 1) - len(req.pages))
        if sch.waiting and len(sch.running) - len(ending) < self.cfg.max_num_seqs:
            return None  # a waiting request gets admitted: schedule after reading this step back
        if pages > pool.num_free or len(sampled) > self.cfg.max_num_batched_tokens:
            return None
        return [r for r in sch.running if id(r) not in ending]


class OverlapLoop:
    """A loop's steps overlapped with the host: see the module docstring."""

    def __init__(self, loop: Loop):
        self.loop = loop
        self.inflight: Launched | None = None

    @property
    def pending(self) -> bool:
        return self.inflight is not None

    def __getattr__(self, name: str):
        """The wrapped loop's counters (num_steps, the speculative counts, ...)."""
        if name == "loop":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.loop, name)

    def step(self) -> list[StepOutput]:
        cur, self.inflight = self.inflight, None
        if cur is None:
            out = self.loop.scheduler.schedule()
            if not out.chunks:
                return []
            cur = self.loop.launch(out)
        self.inflight = self.loop.launch_next(cur)
        if self.inflight is not None:
            self.loop.num_overlapped_steps += 1
        return self.loop.process(cur)
