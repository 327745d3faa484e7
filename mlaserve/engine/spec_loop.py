"""Speculative decoding's step: each decoding request is fed its last token and its drafts (a verify of width
N = K + 1), prefill chunks as usual; then the drafts are verified, the accepted tokens appended, and the proposer
drafts again over every request's new tokens.

A decode-only step stays on the device from verify to draft: launch() verifies (target tokens y [B, N], accepted
counts a [B]: the arg-max rule for greedy requests, the speculative-sampling rule for sampled ones, both batched,
spec/verify.py) and feeds them to the draft's static step (spec/draft_graph.py), and (y, a, drafts) come back
together in one read. Other steps (prefill chunks, a proposer without a device step) read the verify back, then
propose from the host.

Overlapped verify (OverlapLoop, loop.py). While such a step i is in flight, launch_next launches step i+1 from its
device outputs when that schedule is certain whatever step i accepts (next_verify): each request is fed
[y[a], drafts] from the device; its positions, lengths and KV slots are filled on the host for a = 0 (first position
num_computed_tokens + 1) and moved on by a on the device (ForwardBatch.shift_decode), and so is the draft's step.
Pages are taken for the most step i can accept. Then step i is read back and processed: num_computed_tokens grows
by what it accepted, and a request it ends (EOS, a stop, its max_tokens; or an abort meanwhile) has step i+1's
tokens dropped (its pages are freed at once: later work queues behind step i+1). REPLAY's drafts are chosen on the host
after the read (verified_drafts), so its steps do not overlap.

On CUDA such a step of greedy requests is one replay of the step graph (spec_graph.py: the shift, verify, accept,
draft and pack in one graph), which leaves the next step's ids and shifts in its own buffers; with sampled requests,
simulated acceptance, logprobs, logits processors, or at a size it has no graph for, the pieces run one launch each
as above. Logprobs (and top alternatives) are the raw log-softmax of the verify rows at the emitted tokens, as plain
decoding's; logits processors change the verify rows as plain decoding's (_processed), counting the tokens of the
verify in flight on the device in an overlapped step. A grammar (structured output) masks verify row i after the
request's first i drafts (engine/grammar.GrammarAhead), and bad_words match row i's context with those drafts on
the host; a step holding such a request is fed from the host, not overlapped (its masks need the tokens the step
before accepts).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ..attention.base import SeqChunk
from ..layers.logits_process import process_logits
from ..layers.sampler import SamplingRow, sample, top_logprobs
from ..spec.eagle3 import DraftChunk
from ..spec.verify import count_accepted, simulate_accept, verify_greedy, verify_rows
from ..types import Request, RequestStatus
from .grammar import GrammarAhead
from .loop import Loop, seq_chunk
from .postprocess import StepOutput
from .prompt_logprobs import prompt_logprobs
from .scheduler import ScheduledChunk, SchedulerOutput

log = logging.getLogger("mlaserve.engine")


@dataclass
class VerifyStep:
    """A launched verify step: its schedule, the logits of every verified row and prefill's last rows, the EAGLE3
    aux hidden states of every token (the proposer's input), and the drafts it verifies ([B, K] on the device).
    A decode-only step also holds its device outputs (y [B, N], accepted [B], next drafts [B, K] or None)
    and their copy on the way to the host."""

    out: SchedulerOutput
    logits: torch.Tensor
    aux: torch.Tensor | None
    drafts: torch.Tensor | None = None
    verified: tuple | None = None
    rows: QueuedRows | None = None
    next_ids: torch.Tensor | None = None  # [B, N] = [y[a], next drafts] per request: the next verify's input ids
    in_graph: bool = False  # run by the step graph: y, a and the drafts are in `rows`, the next ids in its buffers
    logprobs: tuple | None = None  # QueuedRows of (logprobs [B, N (1 + k)], top ids [B, N k] or None): _logprobs


class QueuedRows:
    """[B, *] integer tensors on the device, side by side, on their way to the host (through pinned memory and an
    event on CUDA, so work queued later does not delay the read); read() is the step's one host sync. written: t is
    pinned host memory the GPU work queued so far writes (the step graph's ring row): only the event."""

    def __init__(self, t: torch.Tensor, written: bool = False):
        self.t = t  # a fresh tensor (static outputs may change), or a ring row valid for HOST_RING steps
        self.ready = None
        if t.is_cuda:
            self.t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        if t.is_cuda or written:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def read(self) -> list[list[int]]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.t.tolist()


def queue_rows(parts: list[torch.Tensor]) -> QueuedRows:
    return QueuedRows(torch.cat([p.to(torch.int64) for p in parts], dim=1))


class SpecLoop(Loop):
    def __init__(self, engine):
        super().__init__(engine)
        self.proposer, self.k = engine.proposer, engine.spec_k
        self.spec_steps = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_accepted_per_position = [0] * self.k  # [i]: verify steps that accepted draft token i + 1
        self.decode_only_steps = 0  # decode-only verify steps: the device path's candidates
        self.spec_device_steps = 0  # of those, the steps that went verify -> accept -> draft on the device
        self._accept_log = [0, 0]  # accepted, steps since the last log line
        spec = engine.spec
        self.simulate = spec.simulate_acceptance if spec is not None else None  # benchmark only (SpecConfig)
        self.step_graphs = getattr(engine, "spec_step_graphs", None)  # spec_graph.py, when captured
        if self.simulate is not None:
            self.sim_gen = torch.Generator(device=self.runner.device).manual_seed(spec.replay_seed)
            log.warning(
                "speculative decoding with simulated acceptance (benchmark only): each draft position accepted with "
                "probability %.3f whatever the target computes; the text is not the model's greedy text",
                self.simulate,
            )

    def set_simulated_acceptance(self, rate: float) -> None:
        """Benchmarks: another simulated acceptance for the engine's next steps (built with one)."""
        if self.simulate is None or not 0 <= rate <= 1:
            raise ValueError(f"simulated acceptance {rate!r}: in [0, 1], on an engine built with one")
        self.simulate = rate

    def _verify(
        self, logits: torch.Tensor, drafts: torch.Tensor, reqs: list[Request], prev: tuple | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, N, V], drafts [B, K] of requests reqs -> (tokens [B, N], accepted [B]) on the device. The rule
        runs on the logits the requests' processors make (penalties, logit_bias, min_tokens: _processed; prev: the
        verify in flight's tokens and accepted counts, for an overlapped step)."""
        pdl = self.runner.kernels.pdl
        processed, greedy = any(r.params.processes_logits for r in reqs), all(r.params.greedy for r in reqs)
        rows = [self._row(r) for r in reqs] if processed or not greedy else None
        if processed:  # a step fed from the host has each request's drafts there (a grammar's masks follow them)
            ahead = [self.states[r.request_id].drafts for r in reqs] if prev is None else None
            logits = self._processed(logits, rows, drafts, prev, ahead)
        if greedy:
            y, acc = verify_greedy(logits, drafts, pdl)
        else:
            y, acc = verify_rows(logits, drafts, rows, self.generator, pdl)
        if self.simulate is not None:
            y, acc = simulate_accept(y, drafts, self.simulate, self.sim_gen)
        return y, acc

    @staticmethod
    def _processed(
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: torch.Tensor,
        prev: tuple | None,
        ahead: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """logits [B, N, V] -> what each request's logits processors (rows [B]: its sampling row) make of them. Row
        i of a request counts as generated its output on the host, then (prev = (y [B, N'], accepted a [B]) of the
        verify in flight, an overlapped step) that verify's tokens y[:a + 1], then its first i drafts (drafts
        [B, K]): the tokens before that row. Those after the output are on the device (process_logits' pending, V
        where unused). A grammar's row i takes its mask after the first i drafts, from the host's copy (ahead [B]:
        each request's drafts), and a bad_words row holds them in its output_ids (its pending emptied); neither
        verifies overlapped (next_verify)."""
        B, N, V = logits.shape
        dev = logits.device
        expanded, on_host = [], []  # on_host: requests whose rows hold their drafts in output_ids (bad_words)
        for b, r in enumerate(rows):
            if (r.grammar is not None or r.params.bad_words) and ahead is None:
                raise RuntimeError("a grammar or bad_words row is verified only with its drafts on the host")
            if r.params.bad_words:
                on_host.append(b)
            chain = GrammarAhead(r.grammar, ahead[b][: N - 1]) if r.grammar is not None else None
            for i in range(N):
                row = r
                if chain is not None:
                    row = dataclasses.replace(row, grammar=chain.row(i))
                if r.params.bad_words:  # the words' starts are matched on the host's tokens
                    row = dataclasses.replace(row, output_ids=r.output_ids + ahead[b][:i])
                expanded.append(row)
        rows = expanded
        i, j = torch.arange(N, device=dev)[:, None], torch.arange(N - 1, device=dev)[None, :]
        pending = torch.where(j < i, drafts.to(torch.int64)[:, None, :], V)  # [B, N, K]: row i's first i drafts
        if on_host:
            pending[torch.tensor(on_host).to(dev, non_blocking=True)] = V  # counted in their output_ids instead
        if prev is not None:
            y, a = prev
            m = torch.arange(y.shape[1], device=dev)[None, :]
            flight = torch.where(m <= a[:, None], y.to(torch.int64), V)  # [B, N']
            pending = torch.cat([flight[:, None, :].expand(B, N, -1), pending], dim=2)
        return process_logits(logits.reshape(B * N, V), rows, pending.reshape(B * N, -1)).view(B, N, V)

    def launch(
        self,
        out: SchedulerOutput,
        decode_tokens: torch.Tensor | None = None,
        decode_shift: torch.Tensor | None = None,
        flight: torch.Tensor | None = None,
    ) -> VerifyStep:
        """Run the verify's forward and, for a decode-only step, verify and draft on the device; no host sync.
        decode_tokens [B, N], decode_shift [B] on the device: an overlapped step (launch_next), whose requests'
        tokens in the verify in flight are flight [B, N] (y; their accepted counts are decode_shift), for the
        logits processors."""
        N = self.k + 1
        if decode_tokens is None:
            drafts = [self.states[c.req.request_id].drafts for c in out.decode]
            decode = [
                SeqChunk(seq_chunk(c.req, 1, True).token_ids + d, c.req.num_computed_tokens, c.req.pages, "all")
                for c, d in zip(out.decode, drafts)
            ]
            key = self._graph_key(out, decode)
            if key is not None:
                return self._launch_in_graph(out, key, decode, None)
            # the drafts on the device for the verify's comparison, queued before the forward (no stream sync)
            dev = torch.tensor(drafts, dtype=torch.int64).to(self.runner.device, non_blocking=True) if drafts else None
            ids = None
        else:  # filled for zero accepted tokens by the step in flight, moved on by decode_shift on the device
            decode = [SeqChunk([0] * N, c.req.num_computed_tokens + 1, c.req.pages, "all") for c in out.decode]
            key = self._graph_key(out, decode)
            if key is not None:
                return self._launch_in_graph(out, key, decode, (decode_tokens, decode_shift))
            dev, ids = decode_tokens[:, 1:], decode_tokens.reshape(-1)
        prefill = [seq_chunk(c.req, c.num_new, c.sample) for c in out.prefill]
        for c, ch in zip(out.prefill, prefill):
            if c.req.params.prompt_logprobs is not None and ch.num_cached < len(c.req.prompt_token_ids):
                ch.need_logits = "all"  # every prompt position's logits (prompt_logprobs.py), as plain decoding's
        logits, aux, _ = self.runner.execute(decode, prefill, decode_tokens=ids, decode_shift=decode_shift)
        if any(ch.need_logits == "all" for ch in prefill):
            logits = prompt_logprobs(out.prefill, prefill, logits, len(decode) * N)
        self.num_steps += 1
        step = VerifyStep(out, logits, aux, dev)
        if out.decode and not out.prefill:
            prev = None if flight is None else (flight, decode_shift)
            self._verify_on_device(step, [c.num_cached for c in decode], decode_shift, prev)
        return step

    def _graph_key(self, out: SchedulerOutput, decode: list[SeqChunk]) -> tuple | None:
        """The step graph's key for a greedy decode-only step (spec_graph.py), or None: no graph for it."""
        sg = self.step_graphs
        if sg is None or self.simulate is not None or out.prefill or not out.decode:
            return None
        if not all(_plain_greedy(c.req.params) for c in out.decode):
            return None  # the step graph takes the raw arg-max and computes no logprobs
        return sg.key(decode)

    def _launch_in_graph(self, out: SchedulerOutput, key: tuple, decode: list[SeqChunk], fed) -> VerifyStep:
        """Verify, accept and draft in one replay of the step graph (fed: SpecStepGraphs.run's)."""
        rows = self.step_graphs.run(key, decode, [c.req for c in out.decode], fed)
        self.num_steps += 1
        self.decode_only_steps += 1
        step = VerifyStep(out, None, None, in_graph=True)
        step.rows = QueuedRows(rows, written=self.runner.device.type == "cuda")  # the CPU's eager step wrote it
        return step

    def _verify_on_device(self, step: VerifyStep, starts: list[int], shift: torch.Tensor | None, prev=None) -> None:
        """Verify, accept and draft from the device outputs, and queue their one read back."""
        out, N = step.out, self.k + 1
        B = len(out.decode)
        self.decode_only_steps += 1
        dec = step.logits[: B * N].view(B, N, -1)
        reqs = [c.req for c in out.decode]
        y, acc = self._verify(dec, step.drafts, reqs, prev)  # [B, N], [B]
        lps = self._logprobs(reqs, dec, y)
        if lps is not None:  # queued before the rows, whose read then finds them copied
            step.logprobs = tuple(None if t is None else QueuedRows(t) for t in lps)
        hidden = step.aux[: B * N] if step.aux is not None else None
        propose = getattr(self.proposer, "propose_verified", None)
        drafts = propose(y, acc, hidden, reqs, starts, shift) if propose is not None else None
        step.verified = (y, acc, drafts)
        if drafts is not None and y.is_cuda:  # one launch for both (kernels/spec_step.py)
            from ..kernels.spec_step import pack_verified

            step.next_ids, rows = pack_verified(y, acc, drafts, self.runner.kernels.pdl)
            step.rows = QueuedRows(rows)
        else:
            step.rows = queue_rows([y, acc[:, None]] + ([drafts] if drafts is not None else []))

    def launch_next(self, cur: VerifyStep) -> VerifyStep | None:
        """Launch the verify after `cur` from cur's device outputs (the module docstring), if its schedule is
        certain; else None."""
        if not cur.in_graph and (
            cur.verified is None or cur.verified[2] is None or hasattr(self.proposer, "verified_drafts")
        ):
            return None  # no device drafts to feed (or REPLAY's, chosen on the host)
        reqs = self.next_verify(cur.out)
        if not reqs:
            return None
        N = self.k + 1
        out = self.scheduler.schedule_verify(reqs, N, 2 * N + self.k)
        if cur.in_graph:  # its ids and shifts wait in the step graph's buffers
            row = {id(c.req): j for j, c in enumerate(cur.out.decode)}
            idx = [row[id(r)] for r in reqs]
            if idx == list(range(len(cur.out.decode))):
                decode = [SeqChunk([0] * N, c.req.num_computed_tokens + 1, c.req.pages, "all") for c in out.decode]
                key = self._graph_key(out, decode)
                if key is not None:
                    return self._launch_in_graph(out, key, decode, "in place")
            ids, acc = self.step_graphs.gather(idx)
            return self.launch(out, decode_tokens=ids, decode_shift=acc)
        y, acc, drafts = cur.verified
        acc = acc.to(torch.int64)  # already int64 from the device kernels and the torch count
        ids = cur.next_ids
        if ids is None:
            ids = torch.cat([y.gather(1, acc[:, None]), drafts.to(torch.int64)], dim=1)  # [B, N]: a fresh tensor
        row = {id(c.req): j for j, c in enumerate(cur.out.decode)}
        idx = [row[id(r)] for r in reqs]
        if idx != list(range(len(cur.out.decode))):
            sel = torch.tensor(idx).to(y.device, non_blocking=True)  # no stream sync
            ids, acc, y = ids[sel], acc[sel], y[sel]
        return self.launch(out, decode_tokens=ids, decode_shift=acc, flight=y)

    def next_verify(self, out: SchedulerOutput) -> list[Request] | None:
        """The requests that verify after `out`, in the scheduler's order, when that schedule is certain whatever
        `out` accepts: `out` is a decode-only step of every running request (each decodes next), no
        waiting request would be admitted, and the pages for the most `out` can accept are free without
        preempting anyone. A request that `out` surely ends by length, or whose next verify could pass
        max_model_len, sits it out; one that `out` may end (by length, EOS, a stop) is fed and its tokens dropped
        if it ends. None: not certain."""
        sch, pool, N = self.scheduler, self.scheduler.pool, self.k + 1
        if out.prefill or not out.decode or len(out.decode) != len(sch.running):
            return None
        ending, pages = set(), 0
        for c in out.decode:
            req = c.req
            if req.status != RequestStatus.RUNNING or req.request_id not in self.states:
                return None
            if self.states[req.request_id].grammar is not None or req.params.bad_words:
                return None  # its masks (its bans) need the tokens `out` accepts, on the host
            if self.post.at_length(req, 1) or req.num_tokens + N >= self.post.max_model_len:
                ending.add(id(req))
            else:
                pages += max(0, pool.pages_for(req.num_computed_tokens + 2 * N + self.k) - len(req.pages))
        n = len(sch.running) - len(ending)
        if sch.waiting and n < self.cfg.max_num_seqs:
            return None  # a waiting request gets admitted: schedule after reading this step back
        if pages > pool.num_free or n * N > self.cfg.max_num_batched_tokens:
            return None
        return [r for r in sch.running if id(r) not in ending]

    def process(self, step: VerifyStep) -> list[StepOutput]:
        """Verify each decode request's drafts, sample finished prefills, then let the draft propose again."""
        if step.verified is not None or step.in_graph:
            return self._process_device(step)
        return self._process_mixed(step)

    def _process_device(self, step: VerifyStep) -> list[StepOutput]:
        """A decode-only step, verified (and drafted, where the proposer can) on the device: its one read back."""
        out, N = step.out, self.k + 1
        drafted = step.in_graph or step.verified[2] is not None  # on the device: the drafts are in the rows
        rows = step.rows.read()  # the step's one host sync
        lps = None if step.logprobs is None else [None if q is None else q.read() for q in step.logprobs]
        if drafted:
            self.spec_device_steps += 1
        final = getattr(self.proposer, "verified_drafts", None)
        results, chunks, accepted = [], [], 0
        for b, c in enumerate(out.decode):
            if c.req.status == RequestStatus.FINISHED:  # ended by the step before, or aborted: drop its tokens
                continue
            a = rows[b][N]
            toks, start = rows[b][: a + 1], c.req.num_computed_tokens
            ev = self._accept(c, toks, *_row_logprobs(c.req, lps, b, a + 1, N))
            results.append(ev)
            accepted += a
            if ev.finished:
                continue
            if not drafted:  # aux is still this step's: no step is launched after one without device drafts
                chunks.append(DraftChunk(c.req, toks, start, _rows(step.aux, b * N, N), propose=True, verify=True))
            else:
                d = rows[b][N + 1 :]
                self.states[c.req.request_id].drafts = final(c.req, d) if final is not None else d
        self._propose(chunks)
        self._log_acceptance(len(results), accepted)
        return results

    def _process_mixed(self, step: VerifyStep) -> list[StepOutput]:
        out, logits, aux = step.out, step.logits, step.aux
        N = self.k + 1
        B = len(out.decode)
        emitted: list[list[int]] = []
        if B:
            dec = logits[: B * N].view(B, N, -1)
            reqs = [c.req for c in out.decode]
            y, acc = self._verify(dec, step.drafts, reqs)
            lps = self._logprobs(reqs, dec, y)
            lps = None if lps is None else [None if t is None else t.tolist() for t in lps]
            y, acc = y.tolist(), acc.tolist()
            emitted = [y[b][: acc[b] + 1] for b in range(B)]
        sampled = [c for c in out.prefill if c.sample]
        rows = [self._row(c.req) for c in sampled]  # with what its logits processors read
        first, first_lps = [], None
        if sampled:
            tail = logits[B * N :]
            first = sample(tail, rows, self.generator, pdl=self.runner.kernels.pdl)[0]
            first_lps = self._logprobs([c.req for c in sampled], tail[:, None], first[:, None])
            first_lps = None if first_lps is None else [None if t is None else t.tolist() for t in first_lps]
            first = first.tolist()

        results, chunks, row = [], [], 0
        for b, c in enumerate(out.decode):
            toks, start = emitted[b], c.req.num_computed_tokens
            ev = self._accept(c, toks, *_row_logprobs(c.req, lps, b, len(toks), N))
            results.append(ev)
            if not ev.finished:
                chunks.append(DraftChunk(c.req, toks, start, _rows(aux, row, N), propose=True, verify=True))
            row += N
        j = 0
        for c in out.prefill:
            req, start = c.req, c.req.num_computed_tokens
            req.num_computed_tokens += c.num_new
            self.scheduler.commit_pages(req)
            finished = False
            if c.sample:
                ev = self.post.append(req, [first[j]], *_row_logprobs(req, first_lps, j, 1, 1))
                j += 1
                results.append(ev)
                finished = ev.finished
            if not finished:
                nxt = req.tokens(start + 1, start + c.num_new + 1)
                chunks.append(DraftChunk(req, nxt, start, _rows(aux, row, c.num_new), propose=c.sample))
            row += c.num_new
        self._propose(chunks)
        self._log_acceptance(B, sum(len(e) - 1 for e in emitted))
        return results

    def _accept(
        self, c: ScheduledChunk, toks: list[int], lps: list[float] | None = None, top: list[dict] | None = None
    ) -> StepOutput:
        """A verified request's emitted tokens (its fed last token's successor + the accepted drafts), with their
        logprobs and top alternatives where it asked: append them, commit their KV, count the acceptance."""
        req, K = c.req, self.k
        req.num_computed_tokens += len(toks)  # the fed last token + the accepted drafts now have KV
        self.scheduler.commit_pages(req)
        ev = self.post.append(req, toks, lps, top)
        accepted = len(ev.new_token_ids) - 1  # accepted drafts actually emitted
        req.spec_steps += 1
        req.spec_draft_tokens += K
        req.spec_accepted_tokens += accepted
        count_accepted(req.spec_accepted_per_position, accepted, K)
        count_accepted(self.spec_accepted_per_position, accepted, K)
        self.spec_steps += 1
        self.spec_draft_tokens += K
        self.spec_accepted_tokens += accepted
        ev.usage = self.post.usage(req)
        return ev

    @staticmethod
    def _logprobs(reqs: list[Request], logits: torch.Tensor, y: torch.Tensor) -> tuple | None:
        """None where no request asked for logprobs, else (the raw logprobs of y [B, N] under logits [B, N, V], then
        each row's top k as [B, N (1 + k)]; their ids [B, N k], or None for k = 0), k the largest params.logprobs:
        the model's raw log-softmax, as plain decoding reports (layers/sampler.py)."""
        ks = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
        if not ks:
            return None
        B, N, V = logits.shape
        flat = logits.reshape(B * N, V).float()
        lp = flat.log_softmax(-1).gather(1, y.reshape(-1, 1).to(torch.int64)).view(B, N)
        k = max(ks)
        if not k:
            return lp, None
        ids, vals = top_logprobs(flat, k)
        return torch.cat([lp, vals.view(B, N * k)], dim=1), ids.view(B, N * k)

    def _propose(self, chunks: list[DraftChunk]) -> None:
        if chunks:
            for rid, d in self.proposer.propose(chunks).items():
                self.states[rid].drafts = d

    def _log_acceptance(self, steps: int, accepted: int) -> None:
        self._accept_log[0] += accepted
        self._accept_log[1] += steps
        if self._accept_log[1] >= 1000:
            a, n = self._accept_log
            log.info(
                "speculative decoding: mean accept length %.3f (%d verify steps; %.1f%% of drafts accepted)",
                1 + a / n,
                n,
                100 * a / (n * self.k),
            )
            self._accept_log = [0, 0]


def _plain_greedy(p) -> bool:
    """A request the step graph serves: greedy, no logits processor, no logprobs."""
    return p.greedy and not p.processes_logits and p.logprobs is None


def _row_logprobs(req: Request, lps: list | None, b: int, n: int, N: int) -> tuple:
    """(logprobs, top alternatives) of row b's first n tokens for postprocess.append, or (None, None) where req
    asked for none; lps: SpecLoop._logprobs' pair as lists, rows of N tokens."""
    k = req.params.logprobs
    if k is None or lps is None:
        return None, None
    vals, ids = lps
    kmax = (len(vals[b]) - N) // N
    tops = [
        dict(zip(ids[b][i * kmax : i * kmax + k], vals[b][N + i * kmax : N + i * kmax + k])) if k else {}
        for i in range(n)
    ]
    return vals[b][:n], tops


def _rows(t: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    return None if t is None else t[start : start + n]
