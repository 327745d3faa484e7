"""A grammar's token bitmask on the logits: token t stays where bit t % 32 of word t // 32 of its row is set, every
other token goes to -inf. The rows' bitmasks are filled on the host (engine/grammar.py: one matcher per request)
while the forward runs on the device, then copied over and applied here, in torch, on the CPU and on CUDA alike."""

from __future__ import annotations

import torch


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [n, W] int32 -> allowed [n, vocab_size] bool (W * 32 >= vocab_size)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made there: no host copy, no sync
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def fill_bitmasks(rows: list, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Each row's next-token bitmask (rows: objects with fill_bitmask(bitmask, row)) -> [n, W] int32 on device,
    copied without a stream sync (pinned on CUDA)."""
    W = (vocab_size + 31) // 32
    host = torch.empty(len(rows), W, dtype=torch.int32, pin_memory=device.type == "cuda")
    for j, g in enumerate(rows):
        g.fill_bitmask(host, j)
    return host.to(device, non_blocking=True)


def apply_bitmask(logits: torch.Tensor, idx: list[int], bitmask: torch.Tensor, raw: torch.Tensor) -> None:
    """logits [B, V] fp32, in place: rows idx keep only their allowed tokens. A row the other processors left
    with no allowed token (min_tokens masking the stop tokens a finished grammar allows) takes the grammar's
    allowed tokens from raw [B, V], the unprocessed logits: the grammar wins."""
    sel = torch.tensor(idx).to(logits.device, non_blocking=True)
    allowed = allowed_tokens(bitmask, logits.shape[1])  # [n, V]
    masked = logits[sel].masked_fill(~allowed, float("-inf"))
    stuck = (masked == float("-inf")).all(-1, keepdim=True)
    logits[sel] = torch.where(stuck, raw[sel].masked_fill(~allowed, float("-inf")), masked)
