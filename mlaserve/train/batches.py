"""Sequence packing: the token stream (files joined, BOS ... EOS each) cut into windows of seq_len + 1 tokens, taken
in an order shuffled per epoch by (seed, epoch). A batch is a pure function of its index, so the data position of a
checkpoint is one number and a resumed run reads exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import numpy as np
import torch


def read_tokens(path: str) -> torch.Tensor:
    """A uint16 token file -> int32 tensor [N] (CPU)."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int32))


class PackedBatches:
    def __init__(self, tokens: torch.Tensor, seq_len: int, batch: int, seed: int):
        self.tokens, self.S, self.B, self.seed = tokens, seq_len, batch, seed
        self.windows = (len(tokens) - 1) // seq_len  # window i: tokens [i*S, i*S + S] (inputs and shifted targets)
        if self.windows < batch:
            raise ValueError(
                f"--micro-batch: the training split has {len(tokens)} tokens, {self.windows} windows of "
                f"{seq_len + 1}; a micro-batch needs {batch} (lower --micro-batch or --seq-len, or add data)"
            )
        self._perm: tuple[int, torch.Tensor] | None = None
        self._span = torch.arange(seq_len + 1, device=tokens.device)

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.windows, generator=g).to(self.tokens.device))
        return self._perm[1]

    def epoch_of(self, index: int) -> float:
        return index * self.B / self.windows

    def __call__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `index` -> (inputs [B, S], targets [B, S]) on the tokens' device, int64."""
        first, got = index * self.B, 0
        starts = []
        while got < self.B:  # a micro-batch may span the end of one epoch and the start of the next
            epoch, pos = divmod(first + got, self.windows)
            starts.append(self._order(epoch)[pos : pos + self.B - got])
            got += len(starts[-1])
        rows = torch.cat(starts) * self.S  # [B]
        seqs = self.tokens[rows[:, None] + self._span].long()  # [B, S+1]
        return seqs[:, :-1], seqs[:, 1:]


def eval_windows(tokens: torch.Tensor, seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token after the first, predicted once: windows of S + 1 tokens at stride S, the last padded (its pad
    targets are -100, which cross_entropy ignores). -> (inputs [W, S], targets [W, S]) int64."""
    n = len(tokens) - 1
    W = max(1, -(-n // seq_len))
    padded = torch.full((W * seq_len + 1,), pad_id, dtype=torch.int64)
    padded[: len(tokens)] = tokens
    idx = torch.arange(W)[:, None] * seq_len + torch.arange(seq_len + 1)
    seqs = padded[idx]
    targets = seqs[:, 1:].clone()
    targets.view(-1)[n:] = -100
    return seqs[:, :-1], targets
