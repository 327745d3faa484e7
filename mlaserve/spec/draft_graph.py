"""The EAGLE3 draft's step after a verify, captured in CUDA graphs per padded batch size.

A decode-only step has fixed shapes: each request extends the draft over all N = K+1 verified positions (rows past
its accepted count a write KV that the next step overwrites before anything reads it; the causal mask keeps them out
of rows <= a), takes row a, then chains K-1 one-token draft steps. The graph's inputs are the verify's target tokens
y [B, N] and accepted counts a [B] (on the device, straight from the verify, or written from the host), each row's
first verified position and the page table (from the host: known before the verify runs). Everything that depends
on a (the row taken, the chained positions, KV slots and lengths) is computed inside the graph, so verify -> accept
-> draft needs no host round trip.
"""

from __future__ import annotations

import logging

import torch

from ..attention.base import ForwardBatch
from ..capture import DECODE_BATCH_SIZES, gc_paused

log = logging.getLogger("mlaserve.spec")


class DraftGraphs:
    """`use_graphs=False` runs the same static step eagerly (the CPU path, and how the CPU tests check it)."""

    def __init__(self, proposer, max_bs: int, max_pages: int, hidden_dim: int, use_graphs: bool = True):
        self.p, self.K, self.N = proposer, proposer.k, proposer.k + 1
        self.bs_list = [b for b in DECODE_BATCH_SIZES if b < max_bs] + [max_bs]
        self.max_pages, self.use_graphs = max_pages, use_graphs
        dev, B, N, K1 = proposer.device, self.bs_list[-1], self.K + 1, max(self.K - 1, 1)
        i64 = dict(dtype=torch.int64, device=dev)
        # inputs
        self.ext_ids = torch.zeros(B * N, **i64)  # y, row by row
        self.acc = torch.zeros(B, **i64)
        self.base = torch.full((B,), -1, **i64)  # each row's first verified position; -1: a padding row
        self.page_table = torch.zeros(B, max_pages, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(B * N, hidden_dim, dtype=proposer.draft.hidden_dtype, device=dev)
        # derived inside the step (_prepare)
        self.ext_pos = torch.zeros(B * N, **i64)
        self.ext_slots = torch.full((B * N,), -1, **i64)
        self.ext_seq = torch.zeros(B, dtype=torch.int32, device=dev)
        self.rows = torch.zeros(B, **i64)
        self.toks = torch.zeros(B, self.K, **i64)  # the drafts [B, K], each step's column written by its arg-max
        self.dec_pos = torch.zeros(K1, B, **i64)
        self.dec_slots = torch.full((K1, B), -1, **i64)
        self.dec_seq = torch.zeros(K1, B, dtype=torch.int32, device=dev)
        self.ar_n = torch.arange(N, **i64)
        self.ar_k = torch.arange(K1, **i64)
        self.row0 = torch.arange(B, **i64) * N
        self._table: tuple | None = None  # (shape, values) of the last page-table write
        self.graphs: dict[int, tuple] = {}  # B -> (graph | None, batches, output [B, K])
        self.pool = None

    def _batches(self, B: int) -> list[ForwardBatch]:
        N, qsl = self.N, torch.arange(B + 1, dtype=torch.int32, device=self.p.device)
        ext = ForwardBatch(
            self.ext_ids[: B * N],
            self.ext_pos[: B * N],
            self.ext_slots[: B * N],
            self.ext_seq[:B],
            qsl * N,
            self.page_table[:B],
            self.rows[:B],
            B,
            N,
            [0] * B,
            [N] * B,
            self.p.attn,
            max_query_len=N,
        )
        decs = [
            ForwardBatch(
                self.ext_ids[:B],
                self.dec_pos[i, :B],
                self.dec_slots[i, :B],
                self.dec_seq[i, :B],
                qsl,
                self.page_table[:B],
                self.rows[:B],
                B,
                1,
                [0] * B,
                [1] * B,
                self.p.attn,
                max_query_len=1,
            )
            for i in range(self.K - 1)
        ]
        return [ext] + decs

    def _prepare(self, B: int) -> None:
        """The extension's and the chain's positions, KV slots and lengths, and the rows taken, from the inputs."""
        N, ps = self.N, self.p.page_size
        if self.base.is_cuda:  # one launch for the torch code below (kernels/spec_step.py)
            from ..kernels.spec_step import draft_positions

            ext = (self.ext_pos[: B * N], self.ext_slots[: B * N], self.ext_seq[:B])
            dec = (self.dec_pos[:, :B], self.dec_slots[:, :B], self.dec_seq[:, :B]) if self.K > 1 else None
            draft_positions(
                self.base[:B], self.acc[:B], self.page_table[:B], ext, self.rows[:B], dec, N, ps, self.p.pdl
            )
            return
        base, acc = self.base[:B], self.acc[:B]
        live = (base >= 0)[:, None]
        start = base.clamp(min=0)
        table = self.page_table[:B]

        def slots(q):  # q [B, m] positions -> their KV slots [B, m]; padding rows write none
            page = table.gather(1, (q // ps).clamp(max=self.max_pages - 1)).long()
            return torch.where(live, page * ps + q % ps, -1)

        q = start[:, None] + self.ar_n  # [B, N]
        self.ext_pos[: B * N].copy_(q.view(-1))
        self.ext_slots[: B * N].copy_(slots(q).view(-1))
        self.ext_seq[:B].copy_(start + N)
        self.rows[:B].copy_(self.row0[:B] + acc)
        if self.K > 1:
            q = (start + acc + 1)[:, None] + self.ar_k  # [B, K-1]: the chained steps' positions
            self.dec_pos[:, :B].copy_(q.T)
            self.dec_slots[:, :B].copy_(slots(q).T)
            self.dec_seq[:, :B].copy_((q + 1).T)

    def _forward(
        self, B: int, batches: list[ForwardBatch], mirrors: bool = False, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """mirrors: fill the chained steps' host lengths (the reference backends read them; eager only). hidden
        [B * N, 3D]: the verify's aux hidden states in place of the `hidden` buffer (the step graph's)."""
        self._prepare(B)
        if mirrors:
            batches[0].seq_lens_cpu[:] = self.ext_seq[:B].tolist()
            for i, b in enumerate(batches[1:]):
                b.seq_lens_cpu[:] = self.dec_seq[i, :B].tolist()
        draft, ext = self.p.draft, batches[0]
        hidden = self.hidden[: B * self.N] if hidden is None else hidden.to(self.hidden.dtype)
        normed, h = draft(ext.input_ids, ext.positions, hidden, ext, rows=self.rows[:B])  # the taken rows only
        toks = self.toks[:B]
        tok = draft.draft_token_ids(normed, out=toks[:, 0])
        for i, b in enumerate(batches[1:], 1):
            normed, h = draft(tok, b.positions, h, b)
            tok = draft.draft_token_ids(normed, out=toks[:, i])
        return toks  # [B, K]

    @torch.inference_mode()
    def capture(self) -> None:
        with gc_paused(self.use_graphs):  # see capture.gc_paused
            self._capture_all()
        what = "captured %d draft graphs" if self.use_graphs else "static draft step, run eagerly, for %d batch sizes"
        log.info(what + " (batch sizes %s, %d draft steps)", len(self.graphs), self.bs_list, self.K)

    def _capture_all(self) -> None:
        for B in reversed(self.bs_list):
            batches = self._batches(B)
            self._fill(B, batches, [], [])
            if not self.use_graphs:
                self.graphs[B] = (None, batches, None)
                continue
            for _ in range(2):
                self._forward(B, batches)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._forward(B, batches)
            self.pool = g.pool()
            self.graphs[B] = (g, batches, out)

    def fits(self, pages: list[list[int]]) -> bool:
        return self.bucket(len(pages)) is not None and all(len(p) <= self.max_pages for p in pages)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.bs_list if b >= n), None)

    def fill_step(self, B: int, starts: list[int], reqs: list) -> None:
        """The step graph's host inputs (engine/spec_graph.py) for requests reqs at their first verified positions."""
        self._fill(B, self.graphs[B][1], starts, [r.pages for r in reqs])

    def _fill(self, B: int, batches: list[ForwardBatch], starts: list[int], pages: list[list[int]]) -> None:
        """The host's inputs: each row's first verified position and the page table (only the columns in use,
        and only when it changed)."""
        pad = B - len(starts)
        self.base[:B].copy_(torch.tensor(starts + [-1] * pad), non_blocking=True)
        width = max([len(p) for p in pages] + [1])
        table = [p + [0] * (width - len(p)) for p in pages] + [[0] * width] * pad
        view = self.page_table[:B, :width]
        if self._table != (view.shape, table):
            view.copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)
            self._table = (view.shape, table)

    @torch.inference_mode()
    def run_verified(
        self,
        y: torch.Tensor,
        acc: torch.Tensor,
        hidden: torch.Tensor,
        starts: list[int],
        pages: list[list[int]],
        shift: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draft after a verify, from its device outputs: y [n, N] target tokens, acc [n] accepted counts,
        hidden [n * N, 3D] its aux hidden states; starts: each row's first verified position, plus shift [n] (int64
        on the device) when the verify was launched before the step before it was read back -> drafts [n, K] on
        the device (a static buffer under graphs: copy it before the next run)."""
        n, N = len(starts), self.N
        B = self.bucket(n)
        graph, batches, out = self.graphs[B]
        self._fill(B, batches, starts, pages)
        self.verified_inputs(y, acc, shift, B)
        self.hidden[: n * N].copy_(hidden)
        if graph is not None:
            graph.replay()
        else:
            out = self._forward(B, batches, mirrors=True)
        return out[:n]

    def verified_inputs(self, y: torch.Tensor, acc: torch.Tensor, shift: torch.Tensor | None, B: int) -> None:
        """The step's device inputs for n = len(y) <= B rows: the verify's tokens y [n, N] and accepted counts acc
        [n] (padding rows take row 0 of their own), and each row's first position moved on by shift [n] if given."""
        n = y.shape[0]
        if y.is_cuda:  # one launch for the torch code below (kernels/spec_step.py)
            from ..kernels.spec_step import draft_inputs

            draft_inputs(y, acc, shift, self.ext_ids, self.acc, self.base, B, self.p.pdl)
            return
        if shift is not None:
            self.base[:n] += shift
        self.ext_ids[: n * self.N].copy_(y.reshape(-1))
        self.acc[:n].copy_(acc)
        if n < B:
            self.acc[n:B].zero_()
