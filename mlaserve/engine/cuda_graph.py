"""CUDA graphs over static input buffers: decode graphs per padded batch size (q_len 1, or N when verifying),
prefill graphs per padded token bucket, and context graphs per (token bucket, context bucket) for prefill chunks
over cached context (a prefix hit's suffix, a long prompt's later chunks). One capture method, one replay method.

Padding is harmless by construction: padded requests have seq_len = q_len, a zero page-table row and slot -1
(the KV store skips negative slots); padded prefill tokens form one extra request of their own. A context graph's
context (the latent rows its attention up-projects, [C, R+P]) has a static length: one more request of no tokens
holds the context bucket's rows the real requests and the padding leave over. Suffix graphs (plain decoding only)
take a step of short suffix chunks as decode rows of SUFFIX_Q tokens in MLA's absorbed form (engine/suffix.py),
per padded request count.

Decode graphs of one token a request also take the greedy arg-max of every row, so a greedy step needs nothing
between two replays but the next step's input copies: the arg-max is written over the graph's own input ids
(already the next step's ids when overlapped decode feeds them from the device: no id copy) and into a row of a
pinned host ring (written over the bus by the kernel: no copy back; the row comes in with the step's inputs).
Verify graphs (N tokens a request) have a ring of N + 1 + K words a request, which the greedy speculative step's
graph (spec_graph.py) writes its read-back rows to.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..attention.base import ForwardBatch, SeqChunk
from ..capture import DECODE_BATCH_SIZES, gc_paused
from ..kernel_config import KernelConfig
from ..layers.sampler import greedy_into
from .suffix import SUFFIX_BATCH_SIZES, SUFFIX_MAX_TOKENS, SUFFIX_Q, last_rows, suffix_on, suffix_rows

log = logging.getLogger("mlaserve.cuda_graph")

# prefill graphs: a fresh prefill pads to the least of these at or above its tokens: from 1,024 each power of two
# and its 5/4, 6/4 and 7/4 (steps of 1.25x or less: a prefill of that size computes in proportion to its padded
# tokens); below, the step reads most of the weights whatever its size, and 768 suffices
PREFILL_TOKEN_BUCKETS = (256, 512, 768, *(p * q // 4 for p in (1024, 2048, 4096, 8192) for q in (4, 5, 6, 7)), 16384)
PREFILL_MAX_REQS = 8  # requests in one prefill graph (plus one padding request; a context graph: two)
# context graphs: chunks of one of these token counts (past the largest the chunk's compute hides an eager step's
# launches), over a total context (cached + new tokens, padded) of one of CONTEXT_BUCKETS: steps of 1.5x and 1.33x
# in turn (the padded rows are up-projected too)
CONTEXT_TOKEN_BUCKETS = (256, 512, 1024, 2048)
CONTEXT_BUCKETS = (512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536)


def decode_graph_sizes(max_num_seqs: int) -> list[int]:
    """The decode graphs' batch sizes (requests) for at most max_num_seqs requests a step."""
    return [b for b in DECODE_BATCH_SIZES if b < max_num_seqs] + [max_num_seqs]


def captured_decode_sizes(max_num_seqs: int, q: int, edge: float) -> list[int]:
    """The decode graphs captured for steps of q tokens a request: those whose tokens stay below edge (a2a_edge)."""
    return [b for b in decode_graph_sizes(max_num_seqs) if b * q < edge]


def decode_graph_size(n_reqs: int, q: int, max_num_seqs: int, edge: float) -> int | None:
    """The decode graph (requests) a decode-only step of n_reqs requests of q tokens pads to: the least captured
    size at or above n_reqs; None past the largest."""
    return next((b for b in captured_decode_sizes(max_num_seqs, q, edge) if b >= n_reqs), None)


def _off_decode_graphs(edge: int, max_num_seqs: int, q: int) -> int:
    """edge raised, where needed, to a decode graph's tokens: a step of n requests (n x q tokens) and its graph
    of b >= n then fall on the same side of it."""
    prev = 0
    for b in decode_graph_sizes(max_num_seqs):
        if (prev + 1) * q <= edge < b * q:
            edge = b * q
        prev = b
    return edge


def _graph_safe_edge(edge: int, max_num_seqs: int, q: int) -> int:
    """edge raised until no CUDA graph holds steps on both sides of it: off the inside of a decode graph's sizes,
    and onto a prefill bucket once it reaches the smallest one (below that, prefill graphs take only the steps
    above it: GraphRunner.key_for). Each move only raises it (a bucket may land inside a decode graph's sizes)."""
    moved = True
    while moved:
        up = _off_decode_graphs(edge, max_num_seqs, q)
        if up >= PREFILL_TOKEN_BUCKETS[0]:
            up = next((t for t in PREFILL_TOKEN_BUCKETS if t >= up), up)
        edge, moved = up, up != edge
    return edge


def graph_safe_kernels(kernels: KernelConfig, max_num_seqs: int, decode_q_len: int) -> KernelConfig:
    """kernels with the FP8 form edges in tokens (KernelConfig.fp8_a8_min_tokens, fp8_linear_a8_min_tokens,
    fp8_scaled_mm_min_rows) moved so that a step and its padded graph twin fall on the same side of each. The
    experts' activation edge: raised, where needed, to the smallest prefill bucket at or above the largest decode
    graph's tokens (max_num_seqs x decode_q_len): decode graphs all at or below, a prefill of n tokens and its
    bucket both above or both at or below; past the largest bucket, that many tokens. The linears' edges:
    _graph_safe_edge. Applied to the config every rank gets, graphs or not, so enforce_eager computes what the
    graphs do. Deterministic mode's edges (W8A8 by the Triton GEMM at every size) stay."""
    if kernels.deterministic:
        return kernels
    need = max(kernels.fp8_a8_min_tokens, max_num_seqs * decode_q_len)
    moved = dict(
        fp8_a8_min_tokens=next((t for t in PREFILL_TOKEN_BUCKETS if t >= need), need),
        fp8_linear_a8_min_tokens=_graph_safe_edge(kernels.fp8_linear_a8_min_tokens, max_num_seqs, decode_q_len),
        fp8_scaled_mm_min_rows=_graph_safe_edge(kernels.fp8_scaled_mm_min_rows, max_num_seqs, decode_q_len),
    )
    if all(getattr(kernels, k) == v for k, v in moved.items()):
        return kernels
    return replace(kernels, **moved)


def a2a_edge(ranks, kernels: KernelConfig) -> float:
    """The fewest tokens of a step that takes the MoE all-to-all (layers/moe_a2a.use_a2a); inf when none does."""
    on = ranks.ep_size > 1 and kernels.moe_a2a_min_tokens is not None
    return kernels.moe_a2a_min_tokens if on else float("inf")


HOST_RING = 4  # rows of the pinned ring decode graphs write their arg-max to; >= 3: the engine reads step N back
# before it launches step N + 2, so a row is read before the step RING later overwrites it


def ring_width(q: int) -> int:
    """int64 words a request of a decode graph of q tokens a request writes to the host ring: its arg-max (q = 1),
    or a speculative step's read-back row [y (q), accepted count, drafts (q - 1)]."""
    return 1 if q == 1 else 2 * q


@dataclass
class GreedyTokens:
    """A decode graph's own arg-max of its real rows, valid until HOST_RING more steps have run."""

    device: torch.Tensor  # [n] int64: the graph's input ids, overwritten (the next step's ids, in order)
    host: torch.Tensor  # [n] int64, a row of the pinned ring: read it after an event recorded behind the replay


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    batch: ForwardBatch
    logits: torch.Tensor  # static output [rows, vocab]
    aux: torch.Tensor | None
    n_reqs: int  # request slots (incl. padding)
    n_tokens: int
    ring_row: torch.Tensor | None = None  # decode graphs: int32 [1], which host ring row a step writes (fill)


class GraphRunner:
    """Owns static buffers shared by every captured graph. `use_graphs=False` runs the same static path eagerly
    (how the CPU tests check the buffer filling and padding)."""

    def __init__(
        self,
        runner,
        decode_q_len: int,
        max_num_seqs: int,
        prefill_max_tokens: int,
        max_pages: int,
        use_graphs: bool = True,
        prefill_max_context: int = 0,
    ):
        self.runner, self.q = runner, decode_q_len
        self.page_size = runner.cfg.page_size
        self.use_graphs = use_graphs
        # Under EP, steps of a2a_edge tokens or more take the MoE all-to-all, which reads its split sizes on the
        # host: no graph holds that many tokens, so such steps (and their eager twins) run eagerly
        edge = a2a_edge(runner.ranks, runner.kernels)
        self.bs_list = captured_decode_sizes(max_num_seqs, decode_q_len, edge)
        # the FP8 form edges (graph_safe_kernels): a prefill graph takes a step on its bucket's side of each
        k = runner.kernels
        self.form_edges = (k.fp8_a8_min_tokens, k.fp8_linear_a8_min_tokens, k.fp8_scaled_mm_min_rows)
        # a context graph's context rows go through kv_b_proj, whose form the edges pick only where it holds an FP8
        # copy (Fp8ExpandedLinear.forward_a8): then the real context and its bucket on the same side of each
        fp8_rows = any(getattr(m, "w8", None) is not None for m in runner.model.modules())
        self.context_edges = self.form_edges if fp8_rows else ()
        self.prefill_buckets = [t for t in PREFILL_TOKEN_BUCKETS if t <= prefill_max_tokens and t < edge]
        self.max_pages = max_pages
        # (tokens, context) of the context graphs: a context past the page table's columns cannot be addressed
        max_ctx = min(prefill_max_context, max_pages * self.page_size)
        self.context_buckets = [
            (t, c)
            for t in self.prefill_buckets
            if t in CONTEXT_TOKEN_BUCKETS
            for c in CONTEXT_BUCKETS
            if t < c <= max_ctx
        ]
        # suffix graphs: plain decoding's steps of short suffixes (engine/suffix.py), below the all-to-all's edge,
        # up to the first size that holds max_num_seqs requests' rows (the sizes are powers of two)
        plain = decode_q_len == 1 and suffix_on(k)
        most = max_num_seqs * -(-SUFFIX_MAX_TOKENS // SUFFIX_Q)
        sizes = [b for b in SUFFIX_BATCH_SIZES if b * SUFFIX_Q < edge and b < 2 * most]
        self.suffix_sizes = sizes if plain else []
        dev = runner.device
        max_bs = self.bs_list[-1] if self.bs_list else 1
        max_reqs = max(max_bs, PREFILL_MAX_REQS + 2)
        max_tokens = max(
            max_bs * self.q, max(self.prefill_buckets, default=0), SUFFIX_Q * max(self.suffix_sizes or [0])
        )
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.greedy = decode_q_len == 1  # decode graphs take the arg-max themselves (module docstring)
        # A step's positions, KV slots and lengths go in one copy (each copy is one more operation between two
        # replays, ~1.5 us of a batch-1 step): each graph's batch views its own region of this buffer (_views).
        # Regions are disjoint, so a graph replayed on its last inputs (a benchmark's replay loop) reads its own
        # inputs, never another graph's (shared layouts would let a batch-32 graph read a smaller graph's lengths
        # as KV slots).
        self._offset: dict[tuple, int] = {}
        words = 0
        for key in self._keys():
            self._offset[key] = words
            words += self._words(*self._sizes(key))
        self.packed = torch.zeros(words, **i64)
        self.logits_indices = torch.zeros(max_tokens, **i64)
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32, device=dev)
        self.page_table = torch.zeros(max_reqs, max_pages, dtype=torch.int32, device=dev)
        self._last: dict[str, tuple] = {}  # _write: the region and values last copied into a buffer
        # [HOST_RING, max_bs x ring_width]: a decode step's arg-max, or a speculative step's read-back rows
        self.ring_width = ring_width(self.q)
        self.host_tokens = torch.zeros(
            HOST_RING, max_bs * self.ring_width, dtype=torch.int64, pin_memory=torch.device(dev).type == "cuda"
        )
        self._ring = 0  # the host ring row of the last (or next: run) decode step
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = None
        # what ran, by kind ("decode": q_len 1, "verify": q_len N, "prefill"): every run of the static path, and
        # those of them that replayed a captured graph (the rest ran the same static path eagerly)
        self.static_runs: Counter[str] = Counter()
        self.graph_replays: Counter[str] = Counter()
        # decode graphs fork the KV store onto it (one stream for all layers and graphs: they never run at once)
        self.side_stream = torch.cuda.Stream(dev) if use_graphs and torch.device(dev).type == "cuda" else None

    # ---- eligibility -----------------------------------------------------------------------------------
    def key_for(self, decode: list[SeqChunk], prefill: list[SeqChunk], suffix: bool = False) -> tuple | None:
        """The graph that takes this step, or None. suffix: a step of short suffix chunks may take a suffix graph
        (runner.execute's suffix)."""
        chunks = decode + prefill
        if not chunks or any(len(c.pages) > self.max_pages for c in chunks):
            return None
        if suffix and not decode and self.suffix_sizes and (rows := suffix_rows(prefill)) is not None:
            b = next((b for b in self.suffix_sizes if b >= len(rows)), None)
            if b is not None and all((len(rows) * SUFFIX_Q > e) == (b * SUFFIX_Q > e) for e in self.form_edges):
                return ("suffix", b)
        if decode and not prefill:
            b = next((b for b in self.bs_list if b >= len(decode)), None)  # decode_graph_size over the captured list
            return None if b is None else ("decode", b)
        if (
            prefill
            and not decode
            and len(prefill) <= PREFILL_MAX_REQS
            and all(c.need_logits != "all" for c in prefill)  # the graph keeps last rows only
        ):
            n = sum(len(c.token_ids) for c in prefill)
            cached = sum(c.num_cached for c in prefill)
            if cached == 0:
                t = next((t for t in self.prefill_buckets if t >= n), None)
                if t is None or any((n > e) != (t > e) for e in self.form_edges):
                    return None
                return ("prefill", t)
            key = next(((t, c) for t, c in self.context_buckets if t >= n and c >= cached + t), None)
            if key is None or any((n > e) != (key[0] > e) for e in self.form_edges):
                return None
            if any((cached + n > e) != (key[1] > e) for e in self.context_edges):
                return None
            return ("context", *key)
        return None

    # ---- static batches --------------------------------------------------------------------------------
    def _keys(self) -> list[tuple]:
        return (
            [("decode", b) for b in self.bs_list]
            + [("prefill", t) for t in self.prefill_buckets]
            + [("context", t, c) for t, c in self.context_buckets]
            + [("suffix", b) for b in self.suffix_sizes]
        )

    @staticmethod
    def _reqs(key: tuple) -> int:
        """Request slots of a prefill or context graph: the real ones, the padding's, and a context graph's
        leftover context's (module docstring)."""
        return PREFILL_MAX_REQS + (2 if key[0] == "context" else 1)

    def _sizes(self, key: tuple) -> tuple[int, int]:
        """(tokens, lengths) of a graph's packed inputs: a decode graph's host ring row follows its requests'
        lengths (_Graph.ring_row)."""
        if key[0] == "decode":
            return key[1] * self.q, key[1] + 1
        if key[0] == "suffix":
            return key[1] * SUFFIX_Q, key[1]
        return key[1], self._reqs(key)

    @staticmethod
    def _words(n_tok: int, n_lens: int) -> int:
        """int64 words of a packed region: [positions | slots | lengths as int32], each part 16-byte aligned."""
        n2 = n_tok + n_tok % 2
        return 2 * n2 + 2 * -(-n_lens // 4)

    def _region(self, key: tuple) -> tuple[int, int, int, int]:
        """(offset, tokens, lengths, words) of key's region of packed; slots start at offset + the even tokens."""
        n_tok, n_lens = self._sizes(key)
        return self._offset[key], n_tok, n_lens, self._words(n_tok, n_lens)

    def _views(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [n_tok] int64, slots [n_tok] int64, lengths [n_lens] int32): key's region of packed."""
        o, n_tok, n_lens, w = self._region(key)
        n2 = n_tok + n_tok % 2
        lens = self.packed[o + 2 * n2 : o + w].view(torch.int32)[:n_lens]
        return self.packed[o : o + n_tok], self.packed[o + n2 : o + n2 + n_tok], lens

    def _q(self, key: tuple) -> int:
        """Tokens a request of a decode or suffix graph holds."""
        return SUFFIX_Q if key[0] == "suffix" else self.q

    def _batch(self, key: tuple) -> ForwardBatch:
        kind, size = key[:2]
        rows = (kind in ("decode", "suffix")) and self._q(key)  # a decode row's tokens
        if kind == "decode":
            n_reqs, n_tok, nd = size, size * self.q, size
            logits_indices = self.logits_indices[:n_tok]  # unused: every row has logits (_forward)
        elif kind == "suffix":  # each request's last row (its real tokens come last)
            n_reqs, n_tok, nd = size, size * SUFFIX_Q, size
            logits_indices = torch.arange(SUFFIX_Q - 1, n_tok, SUFFIX_Q, device=self.input_ids.device)
        else:
            n_reqs, n_tok, nd = self._reqs(key), size, 0
            logits_indices = self.logits_indices[:PREFILL_MAX_REQS]
        positions, slots, lens = self._views(key)
        return ForwardBatch(
            input_ids=self.input_ids[:n_tok],
            positions=positions,
            slot_mapping=slots,
            seq_lens=lens[:n_reqs],
            query_start_loc=self.query_start_loc[: n_reqs + 1],
            page_table=self.page_table[:n_reqs],
            logits_indices=logits_indices,
            num_decode_reqs=nd,
            decode_q_len=rows or 0,
            seq_lens_cpu=[0] * n_reqs,
            query_lens_cpu=[0] * n_reqs,
            attn=self.runner.attn,
            max_query_len=rows or size,
            context_is_new=kind == "prefill",
            side_stream=self.side_stream if rows else None,
        )

    def _fill(self, key: tuple, g: _Graph, chunks: list[SeqChunk], ids_on_device: int = 0) -> None:
        """Write the real chunks into the static buffers, and padding after them. ids_on_device: the first rows'
        input ids come from the device (run's decode_tokens), so the host writes only the rest. A decode graph's
        lengths are followed by the host ring row it writes to (self._ring)."""
        kind = "decode" if key[0] == "suffix" else key[0]  # suffix rows are decode rows of SUFFIX_Q tokens
        q = self._q(key)
        ids, pos, slots, lens, qlens, rows, table = [], [], [], [], [], [], []
        # Only the columns in use are copied: attention reads a row's pages below its seq_len, never past it
        # (a 262k max_model_len would otherwise ship 4k columns per request every step).
        width = max([len(c.pages) for c in chunks] + [1])
        first = 0
        for c in chunks:
            n = len(c.token_ids)
            if kind != "decode":  # long chunks: vector maths (per-token Python costs ms on an 8k prompt)
                p = np.arange(c.num_cached, c.num_cached + n)
                ids.append(np.asarray(c.token_ids, dtype=np.int64))
                pos.append(p)
                slots.append(
                    np.asarray(c.pages, dtype=np.int64)[p // self.page_size] * self.page_size + p % self.page_size
                )
            else:  # decode rows (a suffix row's padding rows first: slot -1)
                ids += c.token_ids
                p = range(c.num_cached, c.num_cached + n)
                pos += p
                slots += [-1] * c.pad + [
                    c.pages[i // self.page_size] * self.page_size + i % self.page_size for i in p[c.pad :]
                ]
            lens.append(c.num_cached + n)
            qlens.append(n)
            if c.need_logits == "all":
                rows += range(first, first + n)
            elif c.need_logits == "last":
                rows.append(first + n - 1)
            table.append(c.pages + [0] * (width - len(c.pages)))
            first += n
        pad_tok = g.n_tokens - first
        if kind == "decode":  # every row has logits, in order: no gather (_forward), so no indices
            pad_reqs = g.n_reqs - len(chunks)
            ids += [0] * pad_tok
            pos += list(range(q)) * pad_reqs
            lens += [q] * pad_reqs
            qlens += [q] * pad_reqs
            rows = []
        else:
            pad_reqs = g.n_reqs - len(chunks)  # the padding tokens form one request; the others are empty
            ids = np.concatenate(ids + [np.zeros(pad_tok, dtype=np.int64)])
            pos = np.concatenate(pos + [np.arange(pad_tok)])
            slots = np.concatenate(slots + [np.full(pad_tok, -1, dtype=np.int64)])
            lens += [pad_tok] + [0] * (pad_reqs - 1)
            qlens += [pad_tok] + [0] * (pad_reqs - 1)
            rows += [0] * (PREFILL_MAX_REQS - len(rows))
            if kind == "context":  # the last request (no tokens) holds the context bucket's leftover rows
                lens[-1] = key[2] - sum(lens)
        if kind == "decode":
            slots += [-1] * pad_tok
        table += [[0] * width] * pad_reqs
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        n_tok = g.n_tokens
        # Each copy is one more operation between two graph replays on the stream (a few us at batch 1): the ids of
        # device-fed rows are not copied, and the query starts and page table only when they change (a decode
        # step's starts never do, its table when a request gains a page).
        if ids_on_device < n_tok:
            self.input_ids[ids_on_device:n_tok].copy_(
                torch.as_tensor(ids[ids_on_device:], dtype=torch.int64), non_blocking=True
            )
        o, _, n_lens, w = self._region(key)
        words = np.zeros(w, dtype=np.int64)  # the layout of _views
        n2 = n_tok + n_tok % 2
        words[:n_tok], words[n2 : n2 + n_tok] = pos, slots
        words[2 * n2 :].view(np.int32)[:n_lens] = lens + [self._ring] if g.ring_row is not None else lens
        self.packed[o : o + w].copy_(torch.from_numpy(words), non_blocking=True)
        self._write("query_start_loc", self.query_start_loc[: g.n_reqs + 1], starts)
        self._write("page_table", self.page_table[: g.n_reqs, :width], table)
        if rows:
            self.logits_indices[: len(rows)].copy_(torch.tensor(rows), non_blocking=True)
        g.batch.seq_lens_cpu[:] = lens  # host mirrors, for eager replay (reference backends) only
        g.batch.query_lens_cpu[:] = qlens

    def _write(self, name: str, view: torch.Tensor, values: list) -> None:
        """view <- values (int32, from the host), unless the last write to buffer `name` put these values in this
        same region (view: a leading block of the buffer, so its shape names the region). Sound because every write
        to these buffers (query starts, page table) comes through here."""
        if self._last.get(name) == (view.shape, values):
            return
        view.copy_(torch.tensor(values, dtype=torch.int32), non_blocking=True)
        self._last[name] = (view.shape, values)

    # ---- capture and replay ----------------------------------------------------------------------------
    def _forward(self, batch: ForwardBatch, ring_row: torch.Tensor | None = None):
        """-> (logits, aux); ring_row: also the arg-max of every row, into the input ids and that host ring row."""
        model = self.runner.model
        out = model(batch.input_ids, batch.positions, batch)
        hidden, aux = out if isinstance(out, tuple) else (out, None)
        if batch.logits_indices.shape[0] < batch.num_tokens:  # prefill, suffix: each request's last row; decode: all
            hidden = hidden[batch.logits_indices]
        logits = model.compute_logits(hidden)
        if ring_row is not None:  # after the model: the embedding has read these ids
            greedy_into(logits, batch.input_ids, self.host_tokens, ring_row, self.runner.kernels.pdl)
        return logits, aux

    def release(self) -> None:
        """Destroy every captured graph now (not when the last reference goes): a graph holding NCCL all-reduces
        keeps ncclCommDestroy waiting forever (pytorch/pytorch#115388), so TP ranks call this before leaving."""
        for g in self.graphs.values():
            if g.graph is not None:
                g.graph.reset()
                g.graph = None
        self.graphs.clear()
        self.pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        with gc_paused(self.use_graphs):
            self._capture_all()
        log.info(
            "captured %d CUDA graphs (decode batch sizes %s x q_len %d; prefill buckets %s; over cached context, "
            "(tokens, context) %s; short suffixes, requests %s x %d tokens) in %.1fs",
            len(self.graphs),
            self.bs_list,
            self.q,
            self.prefill_buckets,
            self.context_buckets,
            self.suffix_sizes,
            SUFFIX_Q,
            time.perf_counter() - t0,
        )
        edge = a2a_edge(self.runner.ranks, self.runner.kernels)
        if edge != float("inf"):
            log.info("steps of %d tokens or more run eagerly: the EP MoE all-to-all (--moe-a2a-min-tokens)", edge)

    def _capture_all(self) -> None:
        # the largest first (the pool grows to it); a context graph's leftover context after the tokens
        for key in sorted(self._keys(), key=lambda k: (-self._sizes(k)[0], -k[-1])):
            batch = self._batch(key)
            g = _Graph(None, batch, None, None, batch.num_reqs, batch.num_tokens)
            if key[0] == "decode":
                g.ring_row = self._views(key)[2][g.n_reqs :]
            self._fill(key, g, [])  # all padding: valid, harmless inputs
            if self.use_graphs:
                for _ in range(2):  # warm up: Triton compiles, allocator settles
                    self._forward(batch, self._argmax_row(g))
                torch.cuda.synchronize()
                g.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g.graph, pool=self.pool):
                    g.logits, g.aux = self._forward(batch, self._argmax_row(g))
                self.pool = g.graph.pool()
            self.graphs[key] = g
        if self.use_graphs:
            torch.cuda.synchronize()

    @torch.inference_mode()
    def run(
        self,
        key: tuple,
        decode: list[SeqChunk],
        prefill: list[SeqChunk],
        decode_tokens: torch.Tensor | None = None,
        decode_shift: torch.Tensor | None = None,
    ):
        """Replay the graph for `key` on these chunks -> (logits of the requested rows, aux of real tokens, the
        graph's GreedyTokens or None). decode_tokens: the decode chunks' input ids on the device, copied in after
        the host's, unless they are the input ids already (the last decode graph's arg-max, in order).
        decode_shift: the decode chunks' positions moved on the device (ForwardBatch.shift_decode)."""
        if key[0] == "suffix":  # the chunks as suffix rows (key_for checked that they are)
            rows = suffix_rows(prefill)
            g = self.fill(key, rows)
            self.static_runs["suffix"] += 1
            if g.graph is not None:
                g.graph.replay()
                self.graph_replays["suffix"] += 1
                logits = g.logits
            else:
                logits, _ = self._forward(g.batch)
            if len(rows) == len(prefill):  # a row a chunk
                return logits[: len(prefill)], None, None
            # each chunk's last row, gathered by views: a list index would copy its indices from pageable host
            # memory, which waits for the replay
            return torch.cat([logits[i : i + 1] for i in last_rows(rows)]), None, None
        chunks = decode + prefill
        n_dec = sum(len(c.token_ids) for c in decode)
        g = self.fill(key, chunks, 0 if decode_tokens is None else n_dec)
        if decode_tokens is not None and not self._are_input_ids(decode_tokens, n_dec):
            self.input_ids[:n_dec].copy_(decode_tokens)
        if decode_shift is not None:
            g.batch.shift_decode(decode_shift, self.page_size, self.runner.kernels.pdl)
        kind = key[0] if key[0] != "decode" else ("decode" if self.q == 1 else "verify")
        self.static_runs[kind] += 1
        if g.graph is not None:
            g.graph.replay()
            self.graph_replays[kind] += 1
            logits, aux = g.logits, g.aux
        else:
            logits, aux = self._forward(g.batch, self._argmax_row(g))
        n_tok = sum(len(c.token_ids) for c in chunks)
        aux = aux[:n_tok] if aux is not None else None
        if key[0] == "decode":  # every token of a decode chunk has a logits row, in order
            greedy = None
            if self.greedy:
                greedy = GreedyTokens(self.input_ids[:n_tok], self.host_tokens[self._ring, :n_tok])
            return logits[:n_tok], aux, greedy
        return logits[: sum(c.need_logits == "last" for c in prefill)], aux, None

    def fill(self, key: tuple, chunks: list[SeqChunk], ids_on_device: int = 0) -> _Graph:
        """Key's graph with these chunks in its static inputs (_fill); a decode graph's step takes the next host
        ring row (self._ring after this)."""
        g = self.graphs[key]
        if g.ring_row is not None:
            self._ring = (self._ring + 1) % HOST_RING
        self._fill(key, g, chunks, ids_on_device)
        return g

    def _argmax_row(self, g: _Graph) -> torch.Tensor | None:
        """The ring row a decode graph of one token a request writes its arg-max to; None for the others."""
        return g.ring_row if self.greedy else None

    def _are_input_ids(self, t: torch.Tensor, n: int) -> bool:
        """t is input_ids[:n] itself (the GreedyTokens.device of the last decode run, every row in order)."""
        return (
            t.data_ptr() == self.input_ids.data_ptr()
            and t.shape == (n,)
            and t.stride(0) == 1
            and t.dtype == self.input_ids.dtype
        )
