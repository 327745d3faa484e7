"""Chain verification of draft tokens against the target's logits.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then add the target's own next
token (so a step emits 1 + accepted tokens, exactly the tokens greedy decoding would produce).
Sampled (temperature > 0): the standard speculative-sampling rule for a deterministic (greedy) draft:
accept draft d with probability p(d); on rejection sample from p with d removed; after K acceptances
sample a bonus token from p. The output distribution is exactly the target's.
"""

from __future__ import annotations

import torch

from ..layers.sampler import SamplingRow, _filter, greedy_tokens


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, N, V], drafts [B, K=N-1] -> (target tokens [B, N], accepted counts [B] int64). pdl: the GPU
    kernels' (the arg-max's, and the count's: one launch, kernels/spec_step.py)."""
    y = greedy_tokens(logits, pdl)
    if y.is_cuda:
        from ..kernels.spec_step import accept_greedy

        return y, accept_greedy(y, drafts, pdl)
    accepted = (drafts == y[:, :-1]).int().cumprod(1).sum(1)
    return y, accepted


def simulate_accept(
    y: torch.Tensor, drafts: torch.Tensor, rate: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Benchmark only (SpecConfig.simulate_acceptance): y [B, N] the target's tokens, drafts [B, K = N-1] -> (the
    emitted tokens [B, N], accepted counts [B]): each draft position accepted with probability `rate` whatever y
    says, up to the first rejection; the emitted row is the accepted drafts, then the target's token after them
    (row a's inputs were the fed token and those drafts, so the text stays causal)."""
    B, K = drafts.shape
    hit = torch.rand((B, K), generator=generator, device=drafts.device) < rate
    acc = hit.int().cumprod(1).sum(1)
    pos = torch.arange(K, device=drafts.device)
    head = torch.where(pos[None, :] < acc[:, None], drafts.to(y.dtype), y[:, :K])
    return torch.cat([head, y[:, K:]], dim=1), acc.to(torch.int64)


def verify_sampled(logits: torch.Tensor, drafts: list[int], row: SamplingRow, generator: torch.Generator) -> list[int]:
    """logits [N, V] of one request -> the emitted tokens (1 + accepted)."""
    g = row.generator or generator
    probs = _filter(logits, [row] * logits.shape[0]).softmax(-1)  # [N, V]
    out = []
    for i, d in enumerate(drafts):
        if torch.rand((), generator=g, device=probs.device) < probs[i, d]:
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=g)))
        return out
    out.append(int(torch.multinomial(probs[-1], 1, generator=g)))
    return out


def count_accepted(counts: list[int], accepted: int, k: int) -> None:
    """Per-position acceptance: counts[i] += 1 for each of the first `accepted` of k draft positions."""
    if len(counts) < k:
        counts += [0] * (k - len(counts))
    for i in range(accepted):
        counts[i] += 1
