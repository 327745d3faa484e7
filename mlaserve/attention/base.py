"""The attention backend protocol and the per-forward batch metadata every backend reads.

A batch holds decode requests first (each with `decode_q_len` new tokens: 1, or N when verifying
speculative tokens), then prefill chunks. Decode tokens take the absorbed MLA form, prefill tokens
the naive form. All metadata is passed explicitly; nothing is global.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SeqChunk:
    """Host-side description of one request's slice of a forward."""

    token_ids: list[int]  # the new tokens fed this step
    num_cached: int  # tokens of this request already in the KV cache (their slots are written)
    pages: list[int]  # the request's page table (covers num_cached + len(token_ids) slots)
    need_logits: str = "last"  # "last" | "all" | "none"
    # leading padding rows (a short suffix as a decode row of a fixed q_len, engine/suffix.py): their KV is not
    # stored (slot -1); the rows attend like any other and their outputs are never read
    pad: int = 0


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset of each new token's KV slot
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    query_start_loc: torch.Tensor  # [B+1] int32: token offsets of each request in the batch
    page_table: torch.Tensor  # [B, max_pages] int32
    logits_indices: torch.Tensor  # [n] int64: rows whose logits are wanted
    num_decode_reqs: int
    decode_q_len: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    attn: AttentionBackend | None = None
    max_query_len: int = 0  # an upper bound on any request's q_len (static under CUDA graphs)
    context_is_new: bool = False  # no prefill request has cached context: its context is this step's tokens
    # decode requests the step's batch-variant attention plan is made for (0: num_decode_reqs): an eager decode-only
    # step gives its padded CUDA-graph twin's size, so both compute their rows alike (engine/runner.py)
    plan_decode_reqs: int = 0
    # a CUDA stream the model may fork independent work onto while this batch is captured in a graph (the graph
    # runner's decode batches: DeepseekV3Attention.forward_decode_forked); None: one stream
    side_stream: torch.cuda.Stream | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def plan_tokens(self) -> int:
        """Tokens the step's batch-variant kernels are planned for: its own, or its padded graph twin's."""
        return max(self.num_tokens, self.plan_decode_reqs * self.decode_q_len)

    def shift_decode(self, shift: torch.Tensor, page_size: int, pdl: bool = True) -> None:
        """Move the first len(shift) decode requests' tokens shift [n] (int64, on the device) positions on: their
        positions, lengths and KV slots (looked up again in the page table; a request shifted by 0 keeps its slots,
        so a padding row's stay -1), all on the device. An overlapped
        verify step is filled for zero accepted tokens before the step in flight has said how many it accepted.
        The host length mirrors follow only for a backend that reads them (one read back). On the GPU one launch
        (kernels/spec_step.py; pdl: its PDL) does what the torch code below does."""
        n, q = shift.shape[0], self.decode_q_len
        if shift.is_cuda:
            from ..kernels.spec_step import shift_decode

            shift_decode(self.positions, self.seq_lens, self.slot_mapping, self.page_table, shift, q, page_size, pdl)
        else:
            pos = self.positions[: n * q].view(n, q)
            pos += shift[:, None]
            self.seq_lens[:n] += shift.to(self.seq_lens.dtype)
            page = self.page_table[:n].gather(1, pos // page_size).long()  # [n, q]
            slots = self.slot_mapping[: n * q].view(n, q)
            slots.copy_(torch.where(shift[:, None] != 0, page * page_size + pos % page_size, slots))
        if self.attn is None or self.attn.reads_host_decode_lens:
            for b, s in enumerate(shift.tolist()):
                self.seq_lens_cpu[b] += s

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_reqs * self.decode_q_len

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(
        cls,
        decode: list[SeqChunk],
        prefill: list[SeqChunk],
        page_size: int,
        device,
        attn: AttentionBackend | None = None,
    ) -> ForwardBatch:
        """Decode chunks must all have the same length (the verify width). The host's arrays go to the device in
        two non-blocking copies from pinned memory (one of int64 words, one of int32): an eager step (a prefill
        chunk with cached context, a step of prefill and decode rows) queues its forward behind the step before
        it without waiting for it, where a copy from pageable memory would wait for the stream."""
        q_lens = {len(c.token_ids) for c in decode}
        if len(q_lens) > 1:
            raise ValueError(f"decode requests must share one query length, got {sorted(q_lens)}")
        chunks = decode + prefill
        n_new = [len(c.token_ids) for c in chunks]
        lens = [c.num_cached + n for c, n in zip(chunks, n_new)]
        starts = [0]
        for n in n_new:
            starts.append(starts[-1] + n)
        T, B = starts[-1], len(chunks)
        rows = []  # logit rows
        for c, first, n in zip(chunks, starts, n_new):
            if c.need_logits == "last":
                rows.append(first + n - 1)
            elif c.need_logits == "all":
                rows += range(first, first + n)
        max_pages = max((len(c.pages) for c in chunks), default=0)
        # int64 words [ids | positions | slots | logit rows], int32 words [seq_lens | starts | page table], each
        # part starting on 16 bytes (so each view's pointer has the alignment its kernels were compiled for)
        o64 = _offsets([T, T, T, len(rows)], 2)
        o32 = _offsets([B, B + 1, B * max_pages], 4)
        w64, w32 = np.zeros(o64[-1], dtype=np.int64), np.zeros(o32[-1], dtype=np.int32)
        ids, pos, slots = w64[o64[0] : o64[0] + T], w64[o64[1] : o64[1] + T], w64[o64[2] : o64[2] + T]
        short_ids, short_pos, short_slots, run = [], [], [], 0  # consecutive short chunks as lists (decode rows)
        for c, first, n in zip(chunks, starts, n_new):
            if n <= _SHORT:
                short_ids += c.token_ids
                p = range(c.num_cached, c.num_cached + n)
                short_pos += p
                short_slots += [-1] * c.pad + [c.pages[i // page_size] * page_size + i % page_size for i in p[c.pad :]]
                continue
            if short_ids:
                ids[run:first], pos[run:first], slots[run:first] = short_ids, short_pos, short_slots
                short_ids, short_pos, short_slots = [], [], []
            p = np.arange(c.num_cached, c.num_cached + n, dtype=np.int64)  # long chunks: vector maths
            ids[first : first + n] = c.token_ids
            pos[first : first + n] = p
            slots[first : first + n] = np.asarray(c.pages, dtype=np.int64)[p // page_size] * page_size + p % page_size
            slots[first : first + c.pad] = -1
            run = first + n
        if short_ids:
            ids[run:T], pos[run:T], slots[run:T] = short_ids, short_pos, short_slots
        w64[o64[3] : o64[3] + len(rows)] = rows
        w32[o32[0] : o32[0] + B] = lens
        w32[o32[1] : o32[1] + B + 1] = starts
        if max_pages:
            table = w32[o32[2] : o32[2] + B * max_pages].reshape(B, max_pages)
            for b, c in enumerate(chunks):
                table[b, : len(c.pages)] = c.pages
        d64, d32 = _to_device(w64, device), _to_device(w32, device)
        return cls(
            input_ids=d64[o64[0] : o64[0] + T],
            positions=d64[o64[1] : o64[1] + T],
            slot_mapping=d64[o64[2] : o64[2] + T],
            seq_lens=d32[o32[0] : o32[0] + B],
            query_start_loc=d32[o32[1] : o32[1] + B + 1],
            page_table=d32[o32[2] : o32[2] + B * max_pages].view(B, max_pages),
            logits_indices=d64[o64[3] : o64[3] + len(rows)],
            num_decode_reqs=len(decode),
            decode_q_len=len(decode[0].token_ids) if decode else 0,
            seq_lens_cpu=lens,
            query_lens_cpu=n_new,
            attn=attn,
            max_query_len=max(n_new, default=0),
            context_is_new=all(c.num_cached == 0 for c in prefill),
        )


_SHORT = 16  # chunks of at most this many tokens are laid out by list (decode rows: no per-chunk numpy calls)


def _offsets(sizes: list[int], align: int) -> list[int]:
    """Start of each part, each rounded up to `align` words, then the total."""
    out = [0]
    for n in sizes:
        out.append(out[-1] + -(-n // align) * align)
    return out


def _to_device(words: np.ndarray, device) -> torch.Tensor:
    """words on the device; from CUDA, through pinned memory and a non-blocking copy (no wait on the stream)."""
    t = torch.from_numpy(words)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class AttentionBackend(ABC):
    """Owns the paged latent cache [layers, pages, page_size, R+P] and computes MLA attention over it.

    An FP8 cache (float8_e4m3fn, kv_fp8.py) comes with kv_scale [layers] float32 (one scale per layer) and dtype,
    the compute dtype its rows are read back in; a cache in the compute dtype needs neither."""

    reads_host_decode_lens = True  # decode reads seq_lens_cpu (the reference backends); False: only the device's

    def __init__(
        self,
        kv_cache: torch.Tensor,
        kv_lora_rank: int,
        kv_scale: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.kv_cache = kv_cache
        self.kv_lora_rank = kv_lora_rank
        self.page_size = kv_cache.shape[2]
        self.fp8 = kv_cache.dtype == torch.float8_e4m3fn
        if self.fp8 and (kv_scale is None or kv_scale.shape != (kv_cache.shape[0],) or dtype is None):
            raise ValueError(f"an FP8 KV cache needs kv_scale [{kv_cache.shape[0]}] (one per layer) and a dtype")
        self.kv_scale = kv_scale
        self.dtype = dtype or kv_cache.dtype  # the compute dtype rows are read back in

    def absorb_q_rope(
        self, q: torch.Tensor, w_kc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, Q: torch.Tensor
    ) -> bool:
        """Q = [q_nope @ w_kc | rope_q(q_pe)] in one launch where the backend has one (q [T, H, N+P], w_kc [H, N, R],
        Q [T, H, R+P]); False: the caller runs the absorption and rope_q itself."""
        return False

    def absorb_q_rope_store_kv(
        self,
        layer_id: int,
        q: torch.Tensor,
        w_kc: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        norm=None,
    ) -> torch.Tensor | None:
        """absorb_q_rope and store_kv(layer_id, c_kv, k_pe, cos, sin, batch, norm) of a decode-only step in one launch
        where the backend has one -> Q [T, H, R+P]; None: nothing was done, the caller runs both its own way."""
        return None

    def rope_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The query's RoPE: x [T, H, P] -> out (any strided view, may alias x)."""
        from ..layers.rotary import apply_rope

        return apply_rope(x, cos, sin, out=out)

    @abstractmethod
    def store_kv(
        self,
        layer_id: int,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        norm=None,
    ) -> None:
        """Write [c_kv | rope(k_pe)] for every token of the batch at its slot. c_kv [T, R], k_pe [T, P].
        norm (an RMSNorm, the kv_a_layernorm): store [norm(c_kv) | rope(k_pe)] instead."""

    @abstractmethod
    def decode(
        self, layer_id: int, q: torch.Tensor, scale: float, batch: ForwardBatch, out: torch.Tensor
    ) -> torch.Tensor:
        """Absorbed attention for the decode tokens. q [Td, H, R+P] -> out [Td, H, R] (o_lat).
        Token j of a request's q_len block sees context up to seq_len - q_len + j (causal in the block)."""

    @abstractmethod
    def prefill_context(self, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """Latent context [C, R+P] of the prefill requests, concatenated (C = their total seq_len)."""

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        k_nope: torch.Tensor,
        k_rope: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Naive-form causal attention for the prefill tokens with k = [k_nope | k_rope] per head, never built:
        q [Tp, H, N+P], k_nope [C, H, N], k_rope [C, P] (shared by all heads), v [C, H, V] -> out [Tp, H, V]
        (all may be strided views). Each request's queries are the last q_len positions of its context."""
