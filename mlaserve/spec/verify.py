"""Chain verification of draft tokens against the target's logits.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then add the target's own next
token (so a step emits 1 + accepted tokens, exactly the tokens greedy decoding would produce).
Sampled (temperature > 0): the standard speculative-sampling rule for a deterministic (greedy) draft:
accept draft d with probability p(d); on rejection sample from p with d removed; after K acceptances
sample a bonus token from p. The output distribution is exactly the target's. Both run batched on the device
(verify_rows), so a step of sampled requests verifies and drafts with no host round trip, as a greedy one does.
"""

from __future__ import annotations

import torch

from ..layers.sampler import SamplingRow, fused_all, greedy_tokens, race_into, race_noise


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, N, V], drafts [B, K=N-1] -> (target tokens [B, N], accepted counts [B] int64). pdl: the GPU
    kernels' (the arg-max's, and the count's: one launch, kernels/spec_step.py)."""
    y = greedy_tokens(logits, pdl)
    return y, _accepted(y, drafts, pdl)


def _accepted(y: torch.Tensor, drafts: torch.Tensor, pdl: bool) -> torch.Tensor:
    """The length of each row's prefix of drafts [B, K] equal to y [B, N]'s first K -> [B] int64."""
    if y.is_cuda:
        from ..kernels.spec_step import accept_greedy

        return accept_greedy(y, drafts, pdl)
    return (drafts == y[:, :-1]).int().cumprod(1).sum(1)


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


def verify_rows(
    logits: torch.Tensor, drafts: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, N, V], drafts [B, K = N-1] on logits' device, rows [B] (each request's params and generator) ->
    (tokens y [B, N], accepted counts [B] int64) on the device, with no host sync. A greedy row's y is the arg-max;
    a sampled row's y[i] is drawn from p_i, its filtered distribution at row i. Either way the drafts are accepted
    while equal to y, and y[a] follows them: for a sampled row, draft d is accepted with probability p(d) and on a
    rejection y[a] is drawn from p without d, the speculative-sampling rule for a deterministic draft. Each sampled
    row draws N x V Exp(1) noise from its request's generator (seeded) or `generator`: the same seed gives the same
    tokens whatever else is in the batch."""
    picked = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not picked:
        return verify_greedy(logits, drafts, pdl)
    B, N, V = logits.shape
    srows = [rows[i] for i in picked]
    if fused_all(logits, rows):
        y = torch.empty(B, N, dtype=torch.int64, device=logits.device)  # the race kernel writes every row
    else:
        y = greedy_tokens(logits, pdl)  # [B, N]; the sampled rows' tokens are written over theirs
    idx = [i * N + n for i in picked for n in range(N)]
    noise = race_noise(srows, N, V, generator, logits.device)  # [S * N, V], row j * N + n: request j, position n
    race_into(y.view(B * N), logits.reshape(B * N, V), [r for r in srows for _ in range(N)], idx, noise, pdl)
    return y, _accepted(y, drafts, pdl)


def count_accepted(counts: list[int], accepted: int, k: int) -> None:
    """Per-position acceptance: counts[i] += 1 for each of the first `accepted` of k draft positions."""
    if len(counts) < k:
        counts += [0] * (k - len(counts))
    for i in range(accepted):
        counts[i] += 1
