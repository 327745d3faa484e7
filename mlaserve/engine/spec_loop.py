"""Speculative decoding's step: each decoding request is fed its last token and its drafts (a verify of width
N = K + 1), prefill chunks as usual; then the drafts are verified, the accepted tokens appended, and the proposer
drafts again over every request's new tokens.

A decode-only step of greedy requests stays on the device from verify to draft: the target's tokens y [B, N] and
accepted counts a [B] feed the draft's static step directly (spec/draft_graph.py), and (y, a, drafts) come back
together in one read. Other steps (prefill chunks, sampled requests, a proposer without a device step) read the
verify back, then propose from the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..attention.base import SeqChunk
from ..layers.sampler import SamplingRow, sample
from ..spec.eagle3 import DraftChunk
from ..spec.verify import count_accepted, verify_greedy, verify_sampled
from .loop import Loop, seq_chunk
from .postprocess import StepOutput
from .scheduler import ScheduledChunk, SchedulerOutput

log = logging.getLogger("mlaserve.engine")


@dataclass
class VerifyStep:
    """A launched verify step: its schedule, the logits of every verified row and prefill's last rows, the EAGLE3
    aux hidden states of every token (the proposer's input), and the drafts it verifies ([B, K] on the device)."""

    out: SchedulerOutput
    logits: torch.Tensor
    aux: torch.Tensor | None
    drafts: torch.Tensor | None = None


def read_rows(parts: list[torch.Tensor]) -> list[list[int]]:
    """[B, *] integer tensors on the device -> their rows side by side, read back in one host sync (through pinned
    memory and an event on CUDA, so work queued later does not delay the read)."""
    t = torch.cat([p.to(torch.int64) for p in parts], dim=1)
    if t.is_cuda:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        ready.synchronize()
        t = host
    return t.tolist()


class SpecLoop(Loop):
    def __init__(self, engine):
        super().__init__(engine)
        self.proposer, self.k = engine.proposer, engine.spec_k
        self.spec_steps = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_accepted_per_position = [0] * self.k  # [i]: verify steps that accepted draft token i + 1
        self.greedy_decode_steps = 0  # decode-only steps of greedy requests: the device path's candidates
        self.spec_device_steps = 0  # of those, the steps that went verify -> accept -> draft on the device
        self._accept_log = [0, 0]  # accepted, steps since the last log line

    def launch(self, out: SchedulerOutput, decode_tokens: torch.Tensor | None = None) -> VerifyStep:
        drafts = [self.states[c.req.request_id].drafts for c in out.decode]
        decode = [
            SeqChunk(seq_chunk(c.req, 1, True).token_ids + d, c.req.num_computed_tokens, c.req.pages, "all")
            for c, d in zip(out.decode, drafts)
        ]
        prefill = [seq_chunk(c.req, c.num_new, c.sample) for c in out.prefill]
        # the drafts on the device for the verify's comparison, queued before the forward (no stream sync)
        dev = torch.tensor(drafts, dtype=torch.int64).to(self.runner.device, non_blocking=True) if drafts else None
        logits, aux, _ = self.runner.execute(decode, prefill)
        self.num_steps += 1
        return VerifyStep(out, logits, aux, dev)

    def launch_next(self, cur: VerifyStep) -> None:
        return None  # verify steps are not overlapped yet (the module docstring of loop.py says how they would be)

    def process(self, step: VerifyStep) -> list[StepOutput]:
        """Verify each decode request's drafts, sample finished prefills, then let the draft propose again."""
        out = step.out
        if out.decode and not out.prefill and all(c.req.params.greedy for c in out.decode):
            return self._process_greedy(step)
        return self._process_mixed(step)

    def _process_greedy(self, step: VerifyStep) -> list[StepOutput]:
        """A decode-only step of greedy requests: verify, accept and draft on the device, then one read back."""
        out, N = step.out, self.k + 1
        B = len(out.decode)
        self.greedy_decode_steps += 1
        dec = step.logits[: B * N].view(B, N, -1)
        y, acc = verify_greedy(dec, step.drafts, self.runner.kernels.pdl)  # [B, N], [B]
        reqs = [c.req for c in out.decode]
        hidden = step.aux[: B * N] if step.aux is not None else None
        propose = getattr(self.proposer, "propose_verified", None)
        drafts = propose(y, acc, hidden, reqs) if propose is not None else None
        rows = read_rows([y, acc[:, None]] + ([drafts] if drafts is not None else []))  # the step's one host sync
        if drafts is not None:
            self.spec_device_steps += 1
        final = getattr(self.proposer, "verified_drafts", None)
        results, chunks = [], []
        for b, c in enumerate(out.decode):
            a = rows[b][N]
            toks, start = rows[b][: a + 1], c.req.num_computed_tokens
            ev = self._accept(c, toks)
            results.append(ev)
            if ev.finished:
                continue
            if drafts is None:
                chunks.append(DraftChunk(c.req, toks, start, _rows(step.aux, b * N, N), propose=True, verify=True))
            else:
                d = rows[b][N + 1 :]
                self.states[c.req.request_id].drafts = final(c.req, d) if final is not None else d
        self._propose(chunks)
        self._log_acceptance(B, sum(r[N] for r in rows))
        return results

    def _process_mixed(self, step: VerifyStep) -> list[StepOutput]:
        out, logits, aux = step.out, step.logits, step.aux
        N = self.k + 1
        B = len(out.decode)
        emitted: list[list[int]] = []
        if B:
            dec = logits[: B * N].view(B, N, -1)
            drafts = [self.states[c.req.request_id].drafts for c in out.decode]
            y, acc = verify_greedy(dec, step.drafts, self.runner.kernels.pdl)
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
        pdl = self.runner.kernels.pdl
        first = sample(logits[B * N :], rows, self.generator, pdl=pdl)[0].tolist() if sampled else []

        results, chunks, row = [], [], 0
        for b, c in enumerate(out.decode):
            toks, start = emitted[b], c.req.num_computed_tokens
            ev = self._accept(c, toks)
            results.append(ev)
            if not ev.finished:
                chunks.append(DraftChunk(c.req, toks, start, _rows(aux, row, N), propose=True, verify=True))
            row += N
        it = iter(first)
        for c in out.prefill:
            req, start = c.req, c.req.num_computed_tokens
            req.num_computed_tokens += c.num_new
            self.scheduler.commit_pages(req)
            finished = False
            if c.sample:
                ev = self.post.append(req, [next(it)], None)
                results.append(ev)
                finished = ev.finished
            if not finished:
                nxt = req.tokens(start + 1, start + c.num_new + 1)
                chunks.append(DraftChunk(req, nxt, start, _rows(aux, row, c.num_new), propose=c.sample))
            row += c.num_new
        self._propose(chunks)
        self._log_acceptance(B, sum(len(e) - 1 for e in emitted))
        return results

    def _accept(self, c: ScheduledChunk, toks: list[int]) -> StepOutput:
        """A verified request's emitted tokens (its fed last token's successor + the accepted drafts): append them,
        commit their KV, count the acceptance."""
        req, K = c.req, self.k
        req.num_computed_tokens += len(toks)  # the fed last token + the accepted drafts now have KV
        self.scheduler.commit_pages(req)
        ev = self.post.append(req, toks, None)
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


def _rows(t: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    return None if t is None else t[start : start + n]
