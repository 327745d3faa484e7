"""Speculative decoding's step: each decoding request is fed its last token and its drafts (a verify of width
N = K + 1), prefill chunks as usual; then the drafts are verified, the accepted tokens appended, and the proposer
drafts again over every request's new tokens."""

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
from .scheduler import SchedulerOutput

log = logging.getLogger("mlaserve.engine")


@dataclass
class VerifyStep:
    """A launched verify step: its schedule, the logits of every verified row and prefill's last rows, and the
    EAGLE3 aux hidden states of every token (the proposer's input)."""

    out: SchedulerOutput
    logits: torch.Tensor
    aux: torch.Tensor | None


class SpecLoop(Loop):
    def __init__(self, engine):
        super().__init__(engine)
        self.proposer, self.k = engine.proposer, engine.spec_k
        self.spec_steps = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_accepted_per_position = [0] * self.k  # [i]: verify steps that accepted draft token i + 1
        self._accept_log = [0, 0]  # accepted, steps since the last log line

    def launch(self, out: SchedulerOutput, decode_tokens: torch.Tensor | None = None) -> VerifyStep:
        decode = [
            SeqChunk(
                seq_chunk(c.req, 1, True).token_ids + self.states[c.req.request_id].drafts,
                c.req.num_computed_tokens,
                c.req.pages,
                "all",
            )
            for c in out.decode
        ]
        prefill = [seq_chunk(c.req, c.num_new, c.sample) for c in out.prefill]
        logits, aux, _ = self.runner.execute(decode, prefill)
        self.num_steps += 1
        return VerifyStep(out, logits, aux)

    def launch_next(self, cur: VerifyStep) -> None:
        return None  # verify steps are not overlapped yet (the module docstring of loop.py says how they would be)

    def process(self, step: VerifyStep) -> list[StepOutput]:
        """Verify each decode request's drafts, sample finished prefills, then let the draft propose again."""
        out, logits, aux = step.out, step.logits, step.aux
        K, N = self.k, self.k + 1
        B = len(out.decode)
        emitted: list[list[int]] = []
        if B:
            dec = logits[: B * N].view(B, N, -1)
            drafts = [self.states[c.req.request_id].drafts for c in out.decode]
            y, acc = verify_greedy(dec, torch.tensor(drafts, device=dec.device), self.runner.kernels.pdl)
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
            req, toks = c.req, emitted[b]
            start = req.num_computed_tokens
            req.num_computed_tokens += len(toks)  # the fed last token + the accepted drafts now have KV
            self.scheduler.commit_pages(req)
            ev = self.post.append(req, toks, None)
            req.spec_steps += 1
            req.spec_draft_tokens += K
            req.spec_accepted_tokens += len(ev.new_token_ids) - 1  # accepted drafts actually emitted
            count_accepted(req.spec_accepted_per_position, len(ev.new_token_ids) - 1, K)
            count_accepted(self.spec_accepted_per_position, len(ev.new_token_ids) - 1, K)
            self.spec_steps += 1
            self.spec_draft_tokens += K
            self.spec_accepted_tokens += len(ev.new_token_ids) - 1
            ev.usage = self.post.usage(req)
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
                ev = self.post.append(req, [next(it)], None)
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
                100 * a / (n * self.k),
            )
            self._accept_log = [0, 0]


def _rows(t: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    return None if t is None else t[start : start + n]
