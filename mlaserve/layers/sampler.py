"""Token sampling: logits processors (penalties, logit_bias, min_tokens: logits_process.py), then greedy or
temperature, top-k, top-p, min-p with per-request seeds; logprobs of the sampled tokens and the top alternatives.

Every row is sampled from its own logits alone; a seeded request draws its noise from its own
generator, so the same seed gives the same tokens whatever else is in the batch. Logprobs are those of the model's
raw logits (vLLM's default, raw_logprobs), before any processor, temperature or mask.
"""

from __future__ import annotations

import torch

from .logits_process import SamplingRow, _to, process_logits

__all__ = ["SamplingRow", "greedy_into", "greedy_tokens", "sample", "top_logprobs"]


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, vectorised over rows. logits [B, V] fp32."""
    dev = logits.device
    temp = _to([r.params.temperature for r in rows], dev).unsqueeze(1)
    logits = logits / temp
    V = logits.shape[1]
    top_k = [r.params.top_k if r.params.top_k > 0 else V for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if min(top_k) < V or min(top_p) < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=dev).unsqueeze(0)
        drop = rank >= _to(top_k, dev).unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top token always stays).
        drop |= (probs.cumsum(-1) - probs) >= _to(top_p, dev).unsqueeze(1)
        logits = logits.scatter(1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    if max(min_p) > 0:
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * _to(min_p, dev).unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def greedy_tokens(logits: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """logits [..., V] -> argmax(-1) [...] int64; on the GPU two short launches (kernels/argmax.py) instead of
    torch's one-block-per-row reduction (8.3 us for a 163840-token row on an H200), with torch's exact result."""
    if logits.is_cuda and logits.dim() >= 1 and logits.is_contiguous() and logits.numel():
        from ..kernels.argmax import argmax_rows

        return argmax_rows(logits.view(-1, logits.shape[-1]), pdl=pdl).view(logits.shape[:-1])
    return logits.argmax(-1)


def greedy_into(
    logits: torch.Tensor, out: torch.Tensor, host: torch.Tensor, host_row: torch.Tensor, pdl: bool = True
) -> None:
    """The greedy tokens of logits [B, V] into out [B] int64 and into row host_row (int32 [1], read when this runs)
    of the host ring host [R, >= B]. On the GPU the arg-max's last kernel writes both, the host row over the bus,
    so a CUDA graph can end with it and no copy launch follows; on the CPU torch's argmax."""
    if logits.is_cuda:
        from ..kernels.argmax import argmax_rows

        argmax_rows(logits, out=out, host=host, host_row=host_row, pdl=pdl)
        return
    tok = logits.argmax(-1)
    out.copy_(tok)
    host[int(host_row)][: tok.numel()] = tok


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    generator: torch.Generator | None = None,
    want_logprobs: bool = False,
    pdl: bool = True,
    pending: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] fp32 -> (tokens [B] int64, logprobs of those tokens under the model [B] or None). pdl: for the
    arg-max kernel (KernelConfig.pdl). pending [B] or None: each row's token in flight (process_logits)."""
    raw, logits = logits, process_logits(logits, rows, pending)
    tokens = greedy_tokens(logits, pdl)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        sel = _to(random_rows, logits.device)
        probs = _filter(logits[sel], [rows[i] for i in random_rows]).softmax(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p; each row draws its own noise.
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            noise[j].exponential_(generator=rows[i].generator or generator)
        tokens[sel] = (probs / noise).argmax(-1)
    logprobs = None
    if want_logprobs:
        logprobs = raw.log_softmax(-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, logprobs


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> the k most likely tokens of each row under the model: (ids [B, k] int64, logprobs [B, k]),
    most likely first (ties: the lower id first, as torch.topk on the CPU and GPU may not, so sorted stably)."""
    lp = logits.float().log_softmax(-1)
    vals, ids = lp.topk(k, dim=-1)
    # order equal logprobs by token id: a reference computed with a stable sort agrees
    order = torch.argsort(ids, dim=-1)
    vals, ids = vals.gather(1, order), ids.gather(1, order)
    order = torch.argsort(-vals, dim=-1, stable=True)
    return ids.gather(1, order), vals.gather(1, order)
