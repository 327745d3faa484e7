"""Token sampling: logits processors (penalties, logit_bias, min_tokens: logits_process.py), then greedy or
temperature, top-k, top-p, min-p with per-request seeds; logprobs of the sampled tokens and the top alternatives.

Every row is sampled from its own logits alone; a seeded request draws its noise from its own
generator, so the same seed gives the same tokens whatever else is in the batch. The filter (_filter), softmax and
race here are the reference; on the GPU race_into runs the filters and the race of the sampled rows in one launch
(kernels/race_sample.py), and those with top-k and top-p over their top-k candidates, over the same noise.
Logprobs are those of the model's raw logits (vLLM's default, raw_logprobs), before any processor, temperature or
mask.
"""

from __future__ import annotations

import torch

from .logits_process import SamplingRow, _to, process_logits

__all__ = [
    "SamplingRow",
    "fused_all",
    "greedy_into",
    "greedy_tokens",
    "race_into",
    "race_noise",
    "sample",
    "top_logprobs",
]


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


def race_noise(rows: list[SamplingRow], n: int, V: int, generator: torch.Generator | None, dev) -> torch.Tensor:
    """Exp(1) noise [S * n, V] for S sampled rows of n positions each (row j's at j * n .. j * n + n - 1): a seeded
    row's from its own generator, the others' in one draw from `generator` (the same stream as one seeded row's when
    S = 1)."""
    S = len(rows)
    e = torch.empty(S * n, V, device=dev)
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    if len(shared) == S:
        return e.exponential_(generator=generator)
    for i, r in enumerate(rows):
        if r.generator is not None:
            e[i * n : (i + 1) * n].exponential_(generator=r.generator)
    if shared:
        idx = _to([i * n + j for i in shared for j in range(n)], dev)
        e[idx] = torch.empty(len(shared) * n, V, device=dev).exponential_(generator=generator)
    return e


def _fused(p, V: int) -> bool:
    """The race kernel samples this row (kernels/race_sample.py); top-k and top-p together: _candidates_into."""
    return not (0 < p.top_k < V and p.top_p < 1.0)


TOPK_CANDIDATES = 1024  # top-k rows the race kernel leaves (those with top-p too) up to this k race over torch.topk


def _candidates(p, V: int) -> bool:
    """A top-k row whose race over its top-k values (_candidates_into) replaces the sort where the kernel cannot."""
    return 0 < p.top_k <= TOPK_CANDIDATES and p.top_k < V and p.top_p < 1.0


def _candidates_into(
    tokens: torch.Tensor, logits: torch.Tensor, rows: list[SamplingRow], idx: list[int], nrow: list[int], noise
) -> None:
    """tokens[idx[j]] for rows with 0 < top_k <= TOPK_CANDIDATES: the reference's filter and race over the row's top-k
    values alone (torch.topk, [n, k_max]), which hold every token the filter keeps: top-p's mass is the top-k
    set's either way, so the same tokens from the same noise (nrow[j]: row j's noise row), without sorting V."""
    dev = logits.device
    sel = _to(idx, dev)
    x = logits[sel].float() / _to([r.params.temperature for r in rows], dev).unsqueeze(1)
    vals, ids = x.topk(max(r.params.top_k for r in rows), dim=-1)  # [n, k], largest first
    drop = torch.arange(vals.shape[1], device=dev) >= _to([r.params.top_k for r in rows], dev).unsqueeze(1)
    probs = vals.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (probs.cumsum(-1) - probs) >= _to([r.params.top_p for r in rows], dev).unsqueeze(1)
    vals = vals.masked_fill(drop, float("-inf"))
    min_p = [r.params.min_p for r in rows]
    if max(min_p) > 0:
        probs = vals.softmax(-1)
        vals = vals.masked_fill(
            probs < probs.max(-1, keepdim=True).values * _to(min_p, dev).unsqueeze(1), float("-inf")
        )
    e = noise[_to(nrow, dev)].gather(1, ids)
    tokens[sel] = ids.gather(1, (vals.softmax(-1) / e).argmax(-1, keepdim=True)).squeeze(1)


def fused_all(logits: torch.Tensor, rows: list[SamplingRow]) -> bool:
    """Every row is sampled and the race kernel takes them all (so no arg-max pass is needed first)."""
    V = logits.shape[-1]
    return logits.is_cuda and all(not r.params.greedy and _fused(r.params, V) for r in rows)


def race_into(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    idx: list[int],
    noise: torch.Tensor,
    pdl: bool = True,
    kernel: bool | None = None,
) -> None:
    """tokens[idx[j]] = a draw from row idx[j] of logits [R, V] filtered by rows[j] (temperature, top-k, top-p,
    min-p), by the exponential race over noise row j: argmax(p / E), E ~ Exp(1), draws from p. tokens [R] int64.
    On the GPU one launch for the rows the race kernel takes, and the race over torch.topk's candidates for those
    with top-k and top-p (_candidates_into); the others (and every row on the CPU) run the reference: the
    sort-based filter, softmax, argmax. kernel: whether to launch the race kernel (default: on the
    GPU; tests set it for CPU tensors under Triton's interpreter)."""
    V, dev = logits.shape[1], logits.device
    kernel = logits.is_cuda if kernel is None else kernel
    fused = [j for j, r in enumerate(rows) if _fused(r.params, V)] if kernel else []
    if fused:
        from ..kernels.race_sample import race_sample

        ps = [rows[j].params for j in fused]
        top_k = [p.top_k if 0 < p.top_k < V else 0 for p in ps]
        par = _to(
            [[idx[j] for j in fused], fused, [1.0 / p.temperature for p in ps], [p.top_p for p in ps]]
            + [[p.min_p for p in ps], top_k],
            dev,
            torch.float32,
        )
        check = any(top_k) or any(p.top_p < 1.0 for p in ps)
        race_sample(logits, noise, par, tokens, any(p.min_p > 0 for p in ps), check, pdl)
    taken = set(fused)  # a set: every sampled row of the step is looked up in it
    cand = [j for j, r in enumerate(rows) if _candidates(r.params, V) and j not in taken] if kernel else []
    if cand:
        _candidates_into(tokens, logits, [rows[j] for j in cand], [idx[j] for j in cand], cand, noise)
    taken |= set(cand)
    rest = [j for j in range(len(rows)) if j not in taken]
    if rest:
        sel, nsel = _to([idx[j] for j in rest], dev), _to(rest, dev)
        probs = _filter(logits[sel].float(), [rows[j] for j in rest]).softmax(-1)
        tokens[sel] = greedy_tokens(probs / noise[nsel], pdl)


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
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if fused_all(logits, rows):
        tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)  # the race kernel writes all
    else:
        tokens = greedy_tokens(logits, pdl)
    if random_rows:
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p; each row draws its own noise.
        srows = [rows[i] for i in random_rows]
        noise = race_noise(srows, 1, logits.shape[1], generator, logits.device)
        race_into(tokens, logits, srows, random_rows, noise, pdl)
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
