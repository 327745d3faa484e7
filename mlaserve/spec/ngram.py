"""The NGRAM proposer: prompt-lookup decoding (vLLM's "ngram" method, SGLang's NGRAM), with no draft model.

Each step a request's K draft tokens are what followed the latest earlier occurrence of its context's longest
suffix n-gram, n from prompt_lookup_max down to prompt_lookup_min, the context being its prompt and its output so
far. Where a request copies from its prompt (code edits, quoting, summaries, structured data) the verify accepts
the copied run; where nothing matches, the draft is the last token repeated and costs the verify's width only.
A continuation shorter than K (a match near the end of the context) is padded with its last token.

A request with a prediction (OpenAI's Predicted Outputs: the output it expects, e.g. the file being edited) is also
looked up in the prediction (after the prompt's last hi - 1 tokens, so n-grams across the join match), which comes
first at each n: an output that follows it is accepted K tokens a step, and one that leaves it (an edit) is found
again as soon as its last n tokens are back in the prediction.

The lookup runs on the device, so NGRAM steps overlap with the host as EAGLE3's do (engine/spec_loop.py): each
request holds a slot, a row of `hist` [max_num_seqs, C] int32 with its context at its positions (and of `pred`,
its prediction). A verify's emitted tokens y[:a + 1] are appended there on the device (ngram_drafts: each row's
first verified position `base` plus the step before's shift, then its accepted count a: the context is
hist[slot, :base + a + 2]), and the drafts looked up from the new context, with no host round trip; a greedy step
runs it inside the step graph (NgramSteps). The host writes a request's whole context when its prompt's last chunk
is computed (and again after a preemption), and a mixed step's emitted tokens, at their positions.
"""

from __future__ import annotations

import logging

import torch

from ..capture import DECODE_BATCH_SIZES
from ..types import Request, RequestStatus

log = logging.getLogger("mlaserve.spec")

PRED_MAX = 32768  # tokens of a prediction looked up (with the prompt's last hi - 1): the rest is not


def ngram_drafts_ref(
    hist: torch.Tensor,
    pred: torch.Tensor,
    pred_lens: torch.Tensor,
    slots: torch.Tensor,
    base: torch.Tensor,
    acc: torch.Tensor,
    y: torch.Tensor,
    k: int,
    lo: int,
    hi: int,
    counts: torch.Tensor,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rule, row by row (kernels/ngram.py runs it on CUDA): for row b with base[b] (+ shift[b]) >= 0, write
    y[b] at hist[slots[b], base + 1:] (within the row), take the context T = hist[slots[b], :base + acc[b] + 2], and
    return the k tokens after the best match of T's suffix: over positions p in [1, len) of the prediction
    (pred[slot, :pred_lens[slot]]) and of T, m(p) = how many tokens before p equal T's last ones (at most hi), best
    the largest m >= lo, the prediction's before T's, then the latest p; its tokens src[min(p + i, len - 1)]; no
    match: T's last token repeated. Padding rows (base < 0) give 0s. counts [2] += [k, k if it matched] a live row."""
    B, N = y.shape
    out = torch.zeros(B, k, dtype=torch.int64, device=y.device)
    C = hist.shape[1]
    for b in range(B):
        if int(base[b]) < 0:
            continue
        counts[0] += k
        s, start = int(slots[b]), int(base[b]) + (int(shift[b]) if shift is not None else 0)
        w = min(N, C - start - 1)
        hist[s, start + 1 : start + 1 + w] = y[b, :w].to(hist.dtype)
        L = start + int(acc[b]) + 2
        T = hist[s, :L].to(torch.int64)
        best = None  # (m, from the prediction, p)
        for src, n_src, is_pred in ((T, L, 0), (pred[s].to(torch.int64), int(pred_lens[s]), 1)):
            p = torch.arange(1, max(n_src, 1), device=T.device)
            alive = torch.ones_like(p, dtype=torch.bool)
            m = torch.zeros_like(p)
            for r in range(1, hi + 1):
                if r > L:
                    break
                ok = p - r >= 0
                alive &= ok & (src[(p - r).clamp(min=0)] == T[L - r])
                m += alive
            hit = (m >= lo).nonzero().flatten()
            if hit.numel():
                key = (m[hit] * 2 * (C + PRED_MAX) + p[hit]).max()  # the largest m, then the latest p
                cand = (int(key) // (2 * (C + PRED_MAX)), is_pred, int(key) % (2 * (C + PRED_MAX)))
                if best is None or cand[:2] > best[:2]:
                    best = cand + (src, n_src)
        if best is None:
            out[b] = T[L - 1]
            continue
        _, _, p, src, n_src = best
        out[b] = src[(p + torch.arange(k, device=T.device)).clamp(max=n_src - 1)]
        counts[1] += k
    return out


class NgramProposer:
    benchmark_only = False

    def __init__(self, spec, runner=None, max_seqs: int = 8, max_len: int = 1024):
        """runner: the target's ModelRunner (its device, max_num_seqs, and the longest context: max_model_len, the
        model's max_position_embeddings if unset, at most what the KV cache holds), or None: a CPU proposer for
        max_seqs requests of max_len tokens (tests)."""
        self.k, self.N = spec.num_steps, spec.num_steps + 1
        self.lo, self.hi = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.device, self.pdl = torch.device("cpu"), False
        if runner is not None:
            self.device, self.pdl = runner.device, runner.kernels.pdl
            max_seqs = runner.cfg.max_num_seqs
            longest = runner.cfg.max_model_len or runner.model_cfg.max_position_embeddings  # the engine's limit
            max_len = min(runner.num_pages * runner.cfg.page_size, longest)  # or what the KV cache holds
        C = max_len + 2 * self.N + 2  # an overlapped verify of a request at the limit writes up to 2 N past it
        i32 = dict(dtype=torch.int32, device=self.device)
        self.hist = torch.zeros(max_seqs, C, **i32)
        self.pred = torch.zeros(max_seqs, min(C, PRED_MAX + self.hi), **i32)
        self.pred_lens = torch.zeros(max_seqs, dtype=torch.int64, device=self.device)
        self.counts = torch.zeros(2, dtype=torch.int64, device=self.device)  # draft tokens looked up; from a match
        self.slot: dict[str, tuple[Request, int]] = {}
        self.free = list(range(max_seqs - 1, -1, -1))
        self.graphs = None  # NgramSteps once capture_graphs() ran
        log.info(
            "NGRAM lookup on the %s: %d request slots of %d tokens (%.1f MB)",
            self.device.type,
            max_seqs,
            C,
            (self.hist.numel() + self.pred.numel()) * 4 / 1e6,
        )

    @property
    def proposed_tokens(self) -> int:
        """Draft tokens looked up, for every row of every step (those of a request its step ended too): a read of
        the device's counter (a host sync)."""
        return int(self.counts[0])

    @property
    def matched_tokens(self) -> int:
        """Of those, the draft tokens that followed a match (a host sync)."""
        return int(self.counts[1])

    def _slot(self, req: Request) -> tuple[int, bool]:
        """req's slot, and whether it is new (its row holds nothing of req's yet). Slots of requests no longer
        running (finished, preempted) are taken back when none is free: later work on such a slot queues on the
        stream behind every step that used it."""
        entry = self.slot.get(req.request_id)
        if entry is not None and entry[0] is req:
            return entry[1], False
        if entry is not None:  # the id reused by another request
            self.free.append(entry[1])
        if not self.free:
            for rid, (r, s) in list(self.slot.items()):
                if r.status != RequestStatus.RUNNING:
                    del self.slot[rid]
                    self.free.append(s)
        if not self.free:
            raise RuntimeError(f"NGRAM: more running requests than its {self.hist.shape[0]} slots")
        s = self.free.pop()
        self.slot[req.request_id] = (req, s)
        return s, True

    def _write_context(self, req: Request) -> int:
        """req's whole context (and prediction) into its slot's rows -> the slot."""
        s, _ = self._slot(req)
        toks = req.prompt_token_ids + req.output_token_ids
        self.hist[s, : len(toks)].copy_(torch.tensor(toks, dtype=torch.int32), non_blocking=True)
        n = 0
        if req.prediction_token_ids:
            prompt = req.prompt_token_ids
            p = prompt[max(0, len(prompt) - self.hi + 1) :] + req.prediction_token_ids
            n = min(len(p), self.pred.shape[1])
            if n < len(p):
                kept = n - (len(p) - len(req.prediction_token_ids))
                log.warning(
                    "request %s: the first %d of its prediction's %d tokens are looked up",
                    req.request_id,
                    kept,
                    len(req.prediction_token_ids),
                )
            self.pred[s, :n].copy_(torch.tensor(p[:n], dtype=torch.int32), non_blocking=True)
        self.pred_lens[s] = n
        return s

    def _drafts(
        self,
        slots: torch.Tensor,
        base: torch.Tensor,
        acc: torch.Tensor,
        y: torch.Tensor,
        shift: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if y.is_cuda:
            from ..kernels.ngram import ngram_drafts

            f = ngram_drafts
            kw = dict(pdl=self.pdl)
        else:
            f, kw = ngram_drafts_ref, {}
        args = (self.hist, self.pred, self.pred_lens, slots, base, acc, y, self.k, self.lo, self.hi, self.counts)
        return f(*args, shift=shift, **kw)

    def _meta(self, rows: list[list[int]]) -> torch.Tensor:
        """rows of ints -> [len(rows), n] int64 on the device (one copy, queued: no stream sync)."""
        return torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def propose_verified(self, y, acc, hidden, reqs, starts=None, shift=None) -> torch.Tensor:
        """Drafts [B, K] on the device after a decode-only verify (y [B, N], acc [B]), its requests' first verified
        positions starts (default their num_computed_tokens) plus shift [B] on the device, if given."""
        starts = [r.num_computed_tokens for r in reqs] if starts is None else starts
        slots = []
        for r in reqs:
            s, new = self._slot(r)
            slots.append(self._write_context(r) if new else s)  # new: a row taken back meanwhile; the host's context
        meta = self._meta([slots, starts])
        return self._drafts(meta[0], meta[1], acc.to(torch.int64), y, shift)

    @torch.inference_mode()
    def propose(self, chunks) -> dict[str, list[int]]:
        """After a step read back on the host: the drafts of the chunks that propose (a verify's emitted tokens, or
        a prompt's last chunk and its first token)."""
        wanted = [c for c in chunks if c.propose]
        if not wanted:
            return {}
        rows = []
        for c in wanted:
            s, new = self._slot(c.req)
            if c.verify and not new:  # the emitted tokens after the context its row holds
                self.hist[s, c.start + 1 : c.start + 1 + len(c.token_ids)].copy_(
                    torch.tensor(c.token_ids, dtype=torch.int32), non_blocking=True
                )
            else:
                s = self._write_context(c.req)
            rows.append(s)
        drafts = self._context_drafts(rows, [c.req for c in wanted])
        return {c.req.request_id: d for c, d in zip(wanted, drafts)}

    def tokens(self, req: Request) -> list[int]:
        """The K draft tokens after req's context as the host holds it (writes all of it: tests, tools)."""
        return self._context_drafts([self._write_context(req)], [req])[0]

    def _context_drafts(self, slots: list[int], reqs: list[Request]) -> list[list[int]]:
        """The K drafts after each request's whole context, which its slot's row holds: the lookup as after a
        verify whose last token (at L - 1) is the context's last, so the row up to it is the context."""
        base = [r.num_tokens - 2 for r in reqs]
        last = [(r.output_token_ids or r.prompt_token_ids)[-1] for r in reqs]
        meta = self._meta([slots, base, last])
        y = meta[2][:, None].expand(len(reqs), self.N).contiguous()  # one kernel variant: a verify's width
        return self._drafts(meta[0], meta[1], torch.zeros_like(meta[0]), y).tolist()

    def capture_graphs(self, max_bs: int, max_pages: int, use_graphs: bool = True) -> None:
        """The lookup's part of the greedy step graph (engine/spec_graph.py): its static inputs."""
        self.graphs = NgramSteps(self, max_bs)

    def warm_up(self) -> None:
        """Compile the lookup kernel's variants (the engine's start-up warm-up)."""
        if self.device.type == "cuda":
            from ..kernels.ngram import warm_up

            warm_up(self.hist, self.pred, self.pred_lens, self.counts, self.N, self.k, self.lo, self.hi, self.pdl)


class NgramSteps:
    """DraftGraphs' interface to engine/spec_graph.py for the NGRAM lookup: no forward, no graph of its own (the
    step graph captures the lookup). Per padded batch size B: each row's first verified position (base, -1 on
    padding rows) and slot, from the host; the verify's y, accepted counts and the shift, from the step."""

    def __init__(self, proposer: NgramProposer, max_bs: int):
        self.p, self.K, self.N = proposer, proposer.k, proposer.N
        self.bs_list = [b for b in DECODE_BATCH_SIZES if b < max_bs] + [max_bs]
        self.graphs = {B: (None, None, None) for B in self.bs_list}
        # a step of B rows: meta[:B] each row's first verified position (-1: padding), meta[B:2B] its slot; one copy
        self.meta = torch.full((2 * self.bs_list[-1],), -1, dtype=torch.int64, device=proposer.device)
        self.base = self.meta  # base[:B]: the step graph's live rows (>= 0)
        self._inputs: tuple | None = None

    def fill_step(self, B: int, starts: list[int], reqs: list[Request]) -> None:
        slots = []
        for r in reqs:
            s, new = self.p._slot(r)
            slots.append(self.p._write_context(r) if new else s)
        pad = B - len(starts)
        self.meta[: 2 * B].copy_(torch.tensor(starts + [-1] * pad + slots + [0] * pad), non_blocking=True)

    def verified_inputs(self, y: torch.Tensor, acc: torch.Tensor, shift: torch.Tensor | None, B: int) -> None:
        self._inputs = (y, acc, shift)

    def _forward(self, B: int, batches=None, mirrors: bool = False, hidden=None) -> torch.Tensor:
        y, acc, shift = self._inputs
        return self.p._drafts(self.meta[B : 2 * B], self.meta[:B], acc, y, shift)
