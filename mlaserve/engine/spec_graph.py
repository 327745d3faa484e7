"""The greedy speculative step as one CUDA graph per padded batch size: the verify, its accepted counts, the draft's
step and the next verify's inputs, with nothing launched from the host between them.

A decode-only step of greedy requests (spec_loop.py) otherwise replays the verify's graph and the draft's graph and
launches, between and after them, the arg-max, the count, the draft's inputs, the pack of the next ids and the
read-back row (kernels/spec_step.py), and the shift of an overlapped verify: each a host launch through Triton's
launcher, on a loop whose host time is the step's time when the model is small. Here one replay runs, for B rows
(the GraphRunner's verify batch for B, and DraftGraphs' static step for B: their buffers, filled by their own code):

    shift    each row's positions, length and KV slots moved on by shift[b] (what the step before accepted; 0 where
             the host filled them exactly, and on padding rows)
    verify   the target's forward over B x N tokens -> logits, aux
    accept   y [B, N] = the arg-max of every row; a [B] = the accepted counts against the fed drafts (ids[:, 1:])
    draft    DraftGraphs' step from (y, a, aux), its first positions moved on by shift -> drafts [B, K]; for NGRAM,
             NgramSteps (spec/ngram.py): y[:a + 1] appended to each request's token row, the lookup from there
    pack     ids <- [y[a], drafts] (the next verify's input ids), shift <- a (0 on padding rows), and the host ring's
             row r (GraphRunner.host_tokens, pinned: written over the bus) <- [y, a, drafts] row by row

The next overlapped step then finds its input ids and shifts in place when its rows are this step's in the same
order; otherwise run() gathers them (gather). `use_graphs=False` runs the same step eagerly with the torch code of
each piece (the CPU, and how the CPU tests check it).
"""

from __future__ import annotations

import logging

import torch

from ..attention.base import SeqChunk
from ..capture import gc_paused
from ..spec.verify import verify_greedy

log = logging.getLogger("mlaserve.spec")


class SpecStepGraphs:
    def __init__(self, graphs, draft_graphs, use_graphs: bool = True):
        """graphs: the GraphRunner of verify graphs (N tokens a request); draft_graphs: the proposer's DraftGraphs
        (or NgramSteps: the same interface)."""
        self.gr, self.dg = graphs, draft_graphs
        self.N = graphs.q
        if draft_graphs.N != self.N:
            raise ValueError(f"step graphs: verify width {self.N}, draft steps for {draft_graphs.N}")
        self.W = graphs.ring_width  # [y (N), a, drafts (N - 1)] a row
        self.use_graphs = use_graphs
        self.bs_list = [b for b in graphs.bs_list if b in draft_graphs.bs_list]
        dev = graphs.runner.device
        self.shift = torch.zeros(max(self.bs_list, default=1), dtype=torch.int64, device=dev)
        self.pdl = graphs.runner.kernels.pdl
        self.page_size = graphs.page_size
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}

    def key(self, decode: list[SeqChunk]) -> tuple | None:
        """The verify graph's key for these decode chunks, if a step graph has its size; else None."""
        key = self.gr.key_for(decode, [])
        return key if key is not None and key[1] in self.graphs else None

    def _step(self, B: int, mirrors: bool = False) -> None:
        """The step on B rows of static inputs (the module docstring). mirrors: the host length mirrors too (the
        reference backends', eager only)."""
        gr, dg, N = self.gr, self.dg, self.N
        batch = gr.graphs[("decode", B)].batch
        shift = self.shift[:B]
        batch.shift_decode(shift, self.page_size, self.pdl)
        logits, aux = gr._forward(batch)
        ids = batch.input_ids.view(B, N)
        y, acc = verify_greedy(logits.view(B, N, -1), ids[:, 1:], self.pdl)
        dg.verified_inputs(y, acc, shift, B)
        drafts = dg._forward(B, dg.graphs[B][1], mirrors=mirrors, hidden=aux)
        ring, row = gr.host_tokens, gr.graphs[("decode", B)].ring_row
        if y.is_cuda:
            from ..kernels.spec_step import pack_step

            pack_step(y, acc, drafts, dg.base[:B], ids, shift, ring, row, self.pdl)
            return
        ring[int(row)][: B * self.W] = torch.cat([y, acc[:, None], drafts.to(y.dtype)], dim=1).reshape(-1)
        ids.copy_(torch.cat([y.gather(1, acc[:, None]), drafts.to(y.dtype)], dim=1))
        shift.copy_(torch.where(dg.base[:B] >= 0, acc, 0))

    @torch.inference_mode()
    def capture(self) -> None:
        with gc_paused(self.use_graphs):
            for B in reversed(self.bs_list):
                key = ("decode", B)
                self.gr._fill(key, self.gr.graphs[key], [])  # all padding: valid, harmless inputs
                self.dg.fill_step(B, [], [])
                self.shift.zero_()
                graph = None
                if self.use_graphs:
                    for _ in range(2):  # warm up: Triton compiles, allocator settles
                        self._step(B)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.gr.pool):
                        self._step(B)
                    self.gr.pool = graph.pool()
                self.graphs[B] = graph
            if self.use_graphs:
                torch.cuda.synchronize()
        what = "captured %d speculative step graphs" if self.use_graphs else "the speculative step, eager, at %d sizes"
        log.info(what + " (batch sizes %s, verify width %d)", len(self.graphs), self.bs_list, self.N)

    def gather(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [n, N], shift [n]) of the last step's rows idx, as it left them (fresh tensors, in stream order)."""
        sel = torch.tensor(idx).to(self.shift.device, non_blocking=True)
        B = max(idx) + 1
        return self.gr.input_ids[: B * self.N].view(B, self.N)[sel], self.shift[sel]

    @torch.inference_mode()
    def run(self, key: tuple, decode: list[SeqChunk], reqs: list, fed=None) -> torch.Tensor:
        """Replay the step graph of `key` (key()) for these decode chunks (each at its first verified position for
        zero accepted tokens before; reqs: their requests). fed: None, the chunks' token_ids are their input
        ids and their positions exact; "in place", the last step left these rows' ids and shifts, in this order;
        or (ids [n, N], shift [n]) on the device. -> the host ring's rows [n, N + 1 + K] = [y, a, drafts], to read
        after an event recorded behind this."""
        gr, dg, N = self.gr, self.dg, self.N
        n, B = len(decode), key[1]
        gr.fill(key, decode, 0 if fed is None else n * N)
        if fed is None:
            self.shift[:B].zero_()
        elif not isinstance(fed, str):
            ids, shift = fed
            gr.input_ids[: n * N].copy_(ids.reshape(-1))
            self.shift[:n].copy_(shift)
            self.shift[n:B].zero_()
        dg.fill_step(B, [c.num_cached for c in decode], reqs)
        gr.static_runs["spec_step"] += 1
        graph = self.graphs[B]
        if graph is not None:
            graph.replay()
            gr.graph_replays["spec_step"] += 1
        else:
            self._step(B, mirrors=True)
        return gr.host_tokens[gr._ring, : n * self.W].view(n, self.W)
