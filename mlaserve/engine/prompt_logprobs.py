"""Prompt logprobs (SamplingParams.prompt_logprobs): a request that asks for them has every prompt position's logits
computed (its prefill chunks ask for "all" rows; it takes no prefix-cache hit, scheduler.py), and the logprob of each
prompt token from the second on is recorded with the top-k alternatives, under the model's raw logits. The first
sampled event carries them (postprocess.py)."""

from __future__ import annotations

import torch

from ..attention.base import SeqChunk
from ..layers.sampler import top_logprobs
from .scheduler import ScheduledChunk


def prompt_logprobs(
    sched: list[ScheduledChunk], chunks: list[SeqChunk], logits: torch.Tensor, first_row: int
) -> torch.Tensor:
    """logits [rows, V] of a step whose prefill chunks (after `first_row` decode rows) may ask for "all" rows ->
    the logits of the rows to sample, as a step of "last" rows would have them. Records each "all" chunk's prompt
    logprobs into its request (a host sync: a rare path)."""
    keep = list(range(first_row))
    row = first_row
    for c, ch in zip(sched, chunks):
        n = {"all": len(ch.token_ids), "last": 1, "none": 0}[ch.need_logits]
        if ch.need_logits == "all":
            _record(c.req, ch.num_cached, logits[row : row + n])
        if c.sample:
            keep.append(row + n - 1)
        row += n
    return logits[torch.tensor(keep, device=logits.device)] if keep else logits[:0]


def _record(req, start: int, logits: torch.Tensor) -> None:
    """logits [n, V] of positions start.. of req: row r predicts the token at start + r + 1."""
    P = len(req.prompt_token_ids)
    n = min(logits.shape[0], P - 1 - start)
    if n <= 0:
        return
    target = torch.tensor(req.prompt_token_ids[start + 1 : start + 1 + n], device=logits.device)
    lp = logits[:n].float().log_softmax(-1).gather(1, target.unsqueeze(1)).squeeze(1).tolist()
    k = req.params.prompt_logprobs
    ids, vals = top_logprobs(logits[:n], k) if k else (None, None)
    ids, vals = (ids.tolist(), vals.tolist()) if k else ([[]] * n, [[]] * n)
    for r in range(n):
        t = req.prompt_token_ids[start + 1 + r]
        req.prompt_logprobs[start + 1 + r] = {t: lp[r], **{i: v for i, v in zip(ids[r], vals[r]) if i != t}}
