"""A step's chunks as one int32 tensor, broadcast from rank 0 over the model's process group (NCCL on GPUs, gloo on the
CPU): no pickling and no host group on the hot path. The other ranks decode it into the same SeqChunks, so every
rank builds the same ForwardBatch and takes the same graph.

Layout, in words: [kind, total words, decode chunks, prefill chunks], then per chunk [tokens, cached, pages,
logits], then every chunk's token ids, then every chunk's pages. The first FIRST_WORDS words go in one broadcast of a
fixed size (the receivers cannot know the size before it); a longer step sends the rest in a second.

A sharded draft's steps (MTP, or an EAGLE3 draft split over the ranks: spec/build.draft_is_sharded) go the same
way, as DRAFT messages: an extension's chunks (DRAFT: token ids, first position, pages, "last" where a chain of
drafts follows), or a verified step's rows (DRAFT_VERIFIED: no token ids, each row's first verified position and
pages; _SHIFT: with the shifts), then the device tensors the step reads (send_tensor: the verify's tokens and
counts, the target hidden states), which never pass through the host.

A step's kind also says how every rank runs it: STEP as the graphs fit it, EAGER as one eager forward (the warm-up's
eager twins), SUFFIX as a STEP of plain decoding whose short suffixes may take the absorbed rows (engine/suffix.py).

Between bursts of steps the other ranks park: rank 0 sends PARK and they wait on the host group (gloo, whose timeout is
long) for "wake", so an idle server never leaves them inside a collective past the model group's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..attention.base import SeqChunk

# EAGER: EagerStep; SUFFIX: SuffixStep
STEP, PARK, DRAFT, DRAFT_VERIFIED, DRAFT_VERIFIED_SHIFT, EAGER, SUFFIX = 1, 2, 3, 4, 5, 6, 7
DRAFT_KINDS = (DRAFT, DRAFT_VERIFIED, DRAFT_VERIFIED_SHIFT)
HEADER = 4
FIRST_WORDS = 4096  # 16 KB: a decode step of 8 requests at an 8k context is ~1.1k words
LOGITS = ("none", "last", "all")  # need_logits by code


@dataclass
class EagerStep:
    """A step every rank runs as one eager forward, whatever graph fits it (the warm-up's eager twins of graphed
    steps, engine/warmup.py)."""

    decode: list[SeqChunk]
    prefill: list[SeqChunk]


@dataclass
class SuffixStep:
    """A step whose short suffix chunks may run as decode rows in the absorbed form (runner.execute's suffix,
    engine/suffix.py): plain decoding's steps."""

    decode: list[SeqChunk]
    prefill: list[SeqChunk]


@dataclass
class DraftMessage:
    """A sharded draft's step (the module docstring): kind, and its chunks."""

    kind: int
    chunks: list[SeqChunk]


def encode(decode: list[SeqChunk], prefill: list[SeqChunk], kind: int = STEP) -> np.ndarray:
    chunks = decode + prefill
    meta = np.array(
        [(len(c.token_ids), c.num_cached, len(c.pages), LOGITS.index(c.need_logits)) for c in chunks], dtype=np.int64
    ).reshape(-1, 4)
    ids = [np.asarray(c.token_ids, dtype=np.int64) for c in chunks]
    pages = [np.asarray(c.pages, dtype=np.int64) for c in chunks]
    words = np.concatenate([np.zeros(HEADER, dtype=np.int64), meta.reshape(-1), *ids, *pages])
    if len(words) and (words.max(initial=0) >= 2**31 or words.min(initial=0) < 0):
        raise ValueError("step: a token id, position or page is outside int32")
    words[:HEADER] = kind, len(words), len(decode), len(prefill)
    return words.astype(np.int32)


def decode_words(words: np.ndarray) -> tuple[list[SeqChunk], list[SeqChunk]]:
    """encode's inverse."""
    _, total, n_dec, n_pre = (int(w) for w in words[:HEADER])
    n = n_dec + n_pre
    meta = words[HEADER : HEADER + 4 * n].reshape(n, 4).tolist()
    ids_at = HEADER + 4 * n
    pages_at = ids_at + sum(m[0] for m in meta)
    chunks = []
    for n_tok, cached, n_pages, logits in meta:
        chunks.append(
            SeqChunk(
                words[ids_at : ids_at + n_tok].tolist(),
                cached,
                words[pages_at : pages_at + n_pages].tolist(),
                LOGITS[logits],
            )
        )
        ids_at += n_tok
        pages_at += n_pages
    assert pages_at == total, f"step message: {pages_at} words decoded, header says {total}"
    return chunks[:n_dec], chunks[n_dec:]


class StepChannel:
    """Rank 0 `send`s each step (and `park`); the other ranks `recv` them, in order. One buffer on the group's device,
    reused: a step's broadcast is queued behind the last step's forward on the same stream."""

    def __init__(self, device: torch.device, group=None):
        self.device, self.group = device, group
        self.buf = torch.zeros(FIRST_WORDS, dtype=torch.int32, device=device)

    def _room(self, n: int) -> None:
        if n > self.buf.numel():
            self.buf = torch.zeros(max(n, 2 * self.buf.numel()), dtype=torch.int32, device=self.device)

    def _broadcast(self, n: int) -> None:
        dist.broadcast(self.buf[:FIRST_WORDS], src=0, group=self.group)
        if n > FIRST_WORDS:
            dist.broadcast(self.buf[FIRST_WORDS:n], src=0, group=self.group)

    def send(self, decode: list[SeqChunk], prefill: list[SeqChunk], kind: int = STEP) -> None:
        words = encode(decode, prefill, kind)
        self._room(len(words))
        # from pageable memory: the host buffer is consumed before copy_ returns, so the next step may reuse it
        self.buf[: len(words)].copy_(torch.from_numpy(words), non_blocking=True)
        self._broadcast(len(words))

    def send_draft(self, kind: int, chunks: list[SeqChunk], tensors: list[torch.Tensor]) -> None:
        """A sharded draft's step: its chunks, then its device tensors, each broadcast as it is."""
        self.send([], chunks, kind)
        for t in tensors:
            self.send_tensor(t)

    def send_tensor(self, t: torch.Tensor) -> None:
        dist.broadcast(t.contiguous(), src=0, group=self.group)

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next tensor rank 0 sent (its shape and dtype known from the message before it)."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(t, src=0, group=self.group)
        return t

    def park(self) -> None:
        self.buf[:HEADER].copy_(torch.tensor([PARK, HEADER, 0, 0], dtype=torch.int32), non_blocking=True)
        self._broadcast(HEADER)

    def recv(self) -> tuple[list[SeqChunk], list[SeqChunk]] | EagerStep | SuffixStep | DraftMessage | None:
        """The next step's (decode, prefill), an EagerStep, a SuffixStep, a DraftMessage (its tensors follow:
        recv_tensor), or None when rank 0 parks the ranks."""
        dist.broadcast(self.buf[:FIRST_WORDS], src=0, group=self.group)
        head = self.buf[:FIRST_WORDS].cpu().numpy()  # waits for the broadcast (and so for rank 0)
        kind, total = int(head[0]), int(head[1])
        if kind == PARK:
            return None
        if kind not in (STEP, EAGER, SUFFIX) and kind not in DRAFT_KINDS:
            raise RuntimeError(f"step message: unknown kind {kind} from rank 0")
        words = head
        if total > FIRST_WORDS:
            self._room(total)
            dist.broadcast(self.buf[FIRST_WORDS:total], src=0, group=self.group)
            words = np.concatenate([head, self.buf[FIRST_WORDS:total].cpu().numpy()])
        decode, prefill = decode_words(words[:total])
        if kind == EAGER:
            return EagerStep(decode, prefill)
        if kind == SUFFIX:
            return SuffixStep(decode, prefill)
        return DraftMessage(kind, prefill) if kind in DRAFT_KINDS else (decode, prefill)
