"""What changes the logits before sampling, vLLM's definitions, batched over the rows that ask for it:

    logit_bias          logits[t] += bias[t]
    allowed_token_ids   every other token at -inf
    bad_words           a word's last token at -inf where the output ends with the tokens before it
    min_tokens          EOS and stop_token_ids at -inf while fewer than min_tokens tokens are generated
    repetition_penalty  a token of the prompt or the output: positive logits / r, negative ones * r
    frequency_penalty   logits -= f * (times the token was generated)
    presence_penalty    logits -= p * (the token was generated)

in that order (bias and masks first, then penalties), and last a grammar's token bitmask (structured output:
grammar_mask.py). No loop over the vocabulary: each is one scatter or one
elementwise op over the rows [P, V]; the host builds only the index lists of the rows' token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..types import SamplingParams
from .grammar_mask import apply_bitmask, fill_bitmasks


@dataclass
class SamplingRow:
    """One row of a sampling batch: its parameters, its own seeded generator (else None), and what the logits
    processors read: the request's tokens and the ids min_tokens masks. cache: per-request tensors kept across
    steps (the prompt's token mask)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and stop_token_ids
    cache: dict | None = None
    grammar: object | None = None  # structured output: fill_bitmask(bitmask, row) (engine/grammar.py)

    def active(self, pending: bool) -> bool:
        """The logits of this row change this step (min_tokens counts a token in flight, `pending`)."""
        p = self.params
        return (
            p.penalized
            or bool(p.logit_bias)
            or p.allowed_token_ids is not None
            or bool(p.bad_words)
            or len(self.output_ids) + pending < p.min_tokens
            or self.grammar is not None
        )


def _to(values: list, dev, dtype=None) -> torch.Tensor:
    """A small host list on `dev` without a stream sync (torch.tensor(..., device=cuda) waits for the stream,
    which would stall the overlapped decode loop behind the step it just launched)."""
    return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)


def process_logits(logits: torch.Tensor, rows: list[SamplingRow], pending: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] fp32 -> the processed logits (a new tensor when any row is active, else logits itself).
    pending int64 on the device, or None: tokens each row generated that its output_ids do not hold yet, which count
    for the penalties and min_tokens: [B], one a row (the step in flight's, overlapped decode), or [B, M], up to M a
    row with V in the unused places (speculation: a verify row's drafts before it, and the tokens of the verify in
    flight), their number known on the device only."""
    V = logits.shape[1]
    n_pend = 0 if pending is None or pending.dim() == 2 else 1  # [B, M]: min_tokens counts on the device below
    act = [i for i, r in enumerate(rows) if r.active(n_pend)]
    if not act:
        return logits
    raw, logits = logits, logits.clone()
    dev = logits.device
    # logit_bias and min_tokens: one index_put each over (row, token) pairs
    ri, ti, vals = [], [], []
    for i in act:
        for t, b in (rows[i].params.logit_bias or {}).items():
            ri.append(i), ti.append(t), vals.append(float(b))
    if ri:
        logits.index_put_((_to(ri, dev), _to(ti, dev)), _to(vals, dev, torch.float32), accumulate=True)
    allow = [i for i in act if rows[i].params.allowed_token_ids is not None]
    if allow:
        keep = torch.stack([_allowed_mask(rows[i], V, dev) for i in allow])
        sel = _to(allow, dev)
        logits[sel] = logits[sel].masked_fill(~keep, float("-inf"))
    ri, ti = [], []
    for i in act:  # bad_words: the host holds every output token (such rows are never sampled with one in flight)
        for seq in (rows[i].cache or {}).get("bad_words", ()):
            if len(seq) == 1 or tuple(rows[i].output_ids[-(len(seq) - 1) :]) == seq[:-1]:
                ri.append(i), ti.append(seq[-1])
    if ri:
        logits[_to(ri, dev), _to(ti, dev)] = float("-inf")
    ri, ti = [], []
    for i in act:
        r = rows[i]
        if len(r.output_ids) + n_pend < r.params.min_tokens:
            ids = sorted(t for t in r.stop_ids if t < V)
            ri += [i] * len(ids)
            ti += ids
    if ri:
        ri, ti = _to(ri, dev), _to(ti, dev)
        masked = torch.full((), float("-inf"), device=dev)  # a fill on the device: torch.tensor(...) would sync
        if n_pend != 1 and pending is not None:  # only where the output with its pending tokens is still short
            short = _to([len(r.output_ids) for r in rows], dev) + (pending < V).sum(1) < _to(
                [r.params.min_tokens for r in rows], dev
            )
            masked = torch.where(short[ri], masked, logits[ri, ti])
        logits.index_put_((ri, ti), masked)
    pen = [i for i in act if rows[i].params.penalized]
    if pen:
        logits[_to(pen, dev)] = _penalize(logits[_to(pen, dev)], [rows[i] for i in pen], pending, pen)
    gram = [i for i in act if rows[i].grammar is not None]
    if gram:
        # the matcher has not seen the tokens pending: its mask would be behind, unless the row's grammar feeds them
        # itself (a verify row's, after the drafts before it: engine/grammar.GrammarAhead)
        if pending is not None and not all(getattr(rows[i].grammar, "covers_pending", False) for i in gram):
            raise RuntimeError("a grammar row cannot be sampled while its previous token is in flight")
        apply_bitmask(logits, gram, fill_bitmasks([rows[i].grammar for i in gram], V, dev), raw)
    return logits


def _penalize(x: torch.Tensor, rows: list[SamplingRow], pending: torch.Tensor | None, idx: list[int]) -> torch.Tensor:
    """x [P, V]: repetition, then frequency and presence penalties (vLLM's apply_penalties)."""
    dev, (P, V) = x.device, x.shape
    L = max(len(r.output_ids) for r in rows)
    one = pending is not None and pending.dim() == 1
    ids = torch.full((P, L + one), V, dtype=torch.int64)  # V: a padding column, dropped below
    for j, r in enumerate(rows):
        if r.output_ids:
            ids[j, : len(r.output_ids)] = torch.tensor(r.output_ids, dtype=torch.int64)
    ids = ids.to(dev, non_blocking=True)
    if one:
        ids[:, -1] = pending[_to(idx, dev)]
    elif pending is not None:  # [B, M], V in the unused places
        ids = torch.cat([ids, pending[_to(idx, dev)]], dim=1)
    counts = torch.zeros(P, V + 1, device=dev).scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    counts = counts[:, :V]  # [P, V]
    seen = counts > 0
    rep = [r.params.repetition_penalty for r in rows]
    if any(v != 1.0 for v in rep):
        seen_all = seen | torch.stack([_prompt_mask(r, V, dev) for r in rows])
        factor = torch.where(seen_all, _to(rep, dev, torch.float32).unsqueeze(1), 1.0)
        x = torch.where(x > 0, x / factor, x * factor)
    freq = _to([float(r.params.frequency_penalty) for r in rows], dev, torch.float32).unsqueeze(1)
    pres = _to([float(r.params.presence_penalty) for r in rows], dev, torch.float32).unsqueeze(1)
    return x - freq * counts - pres * seen


def _allowed_mask(r: SamplingRow, V: int, dev) -> torch.Tensor:
    """[V] bool: the tokens the row may generate (allowed_token_ids), made once per request."""
    mask = r.cache.get("allowed_mask") if r.cache is not None else None
    if mask is None:
        mask = torch.zeros(V, dtype=torch.bool, device=dev)
        mask[_to(sorted(set(r.params.allowed_token_ids)), dev)] = True
        if r.cache is not None:
            r.cache["allowed_mask"] = mask
    return mask


def _prompt_mask(r: SamplingRow, V: int, dev) -> torch.Tensor:
    """[V] bool: the tokens of the row's prompt, made once per request (a prompt can be long)."""
    mask = r.cache.get("prompt_mask") if r.cache is not None else None
    if mask is None:
        mask = torch.zeros(V, dtype=torch.bool, device=dev)
        ids = [t for t in r.prompt_ids if t < V]
        if ids:
            mask[_to(ids, dev)] = True
        if r.cache is not None:
            r.cache["prompt_mask"] = mask
    return mask
