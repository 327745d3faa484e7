"""The EAGLE3 draft's step after a verify, captured in CUDA graphs per padded batch size.

A decode-only step has fixed shapes: each request extends the draft over all N = K+1 verified positions (rows past
its accepted count a write KV that the next step overwrites before anything reads it; the causal mask keeps them out
of rows <= a), takes row a, then chains K-1 one-token draft steps. All positions and slots are known on the host
once the verify's tokens are, so the host fills static buffers and replays one graph.
"""

from __future__ import annotations

import logging

import torch

from ..attention.base import ForwardBatch
from ..capture import DECODE_BATCH_SIZES, gc_paused

log = logging.getLogger("mlaserve.spec")


class DraftGraphs:
    def __init__(self, proposer, max_bs: int, max_pages: int, hidden_dim: int, use_graphs: bool = True):
        self.p, self.K, self.N = proposer, proposer.k, proposer.k + 1
        self.bs_list = [b for b in DECODE_BATCH_SIZES if b < max_bs] + [max_bs]
        self.max_pages, self.use_graphs = max_pages, use_graphs
        dev, B, N = proposer.device, self.bs_list[-1], self.K + 1
        i64 = dict(dtype=torch.int64, device=dev)
        self.ext_ids = torch.zeros(B * N, **i64)
        self.ext_pos = torch.zeros(B * N, **i64)
        self.ext_slots = torch.full((B * N,), -1, **i64)
        self.ext_seq = torch.zeros(B, dtype=torch.int32, device=dev)
        self.rows = torch.zeros(B, **i64)
        self.dec_pos = torch.zeros(max(self.K - 1, 1), B, **i64)
        self.dec_slots = torch.full((max(self.K - 1, 1), B), -1, **i64)
        self.dec_seq = torch.zeros(max(self.K - 1, 1), B, dtype=torch.int32, device=dev)
        self.page_table = torch.zeros(B, max_pages, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(B * N, hidden_dim, dtype=proposer.draft.fc.weight.dtype, device=dev)
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

    def _forward(self, B: int, batches: list[ForwardBatch]) -> torch.Tensor:
        draft, ext = self.p.draft, batches[0]
        normed, h = draft(ext.input_ids, ext.positions, self.hidden[: B * self.N], ext)
        tok, h = draft.draft_token_ids(normed[self.rows[:B]]), h[self.rows[:B]]
        toks = [tok]
        for b in batches[1:]:
            normed, h = draft(tok, b.positions, h, b)
            tok = draft.draft_token_ids(normed)
            toks.append(tok)
        return torch.stack(toks, dim=1)  # [B, K]

    @torch.inference_mode()
    def capture(self) -> None:
        with gc_paused(self.use_graphs):  # see capture.gc_paused
            self._capture_all()
        log.info("captured %d draft graphs (batch sizes %s, %d draft steps)", len(self.graphs), self.bs_list, self.K)

    def _capture_all(self) -> None:
        for B in reversed(self.bs_list):
            batches = self._batches(B)
            self._fill(B, batches, [])
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

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.bs_list if b >= n), None)

    def _fill(self, B: int, batches: list[ForwardBatch], chunks) -> None:
        N, K, ps = self.N, self.K, self.p.page_size
        ids, pos, slots, seq, rows, table = [], [], [], [], [], []
        width = max([len(c.req.pages) for c in chunks] + [1])  # only the page-table columns in use
        dpos, dslots, dseq = [[] for _ in range(K - 1)], [[] for _ in range(K - 1)], [[] for _ in range(K - 1)]

        def slot(pages, q):
            return pages[q // ps] * ps + q % ps

        for b, c in enumerate(chunks):
            a = len(c.token_ids) - 1
            ids += c.token_ids + [c.token_ids[-1]] * (N - 1 - a)
            pos += range(c.start, c.start + N)
            slots += [slot(c.req.pages, q) for q in range(c.start, c.start + N)]
            seq.append(c.start + N)
            rows.append(b * N + a)
            table.append(c.req.pages + [0] * (width - len(c.req.pages)))
            for i in range(K - 1):
                q = c.start + a + 1 + i
                dpos[i].append(q)
                dslots[i].append(slot(c.req.pages, q))
                dseq[i].append(q + 1)
        pad = B - len(chunks)
        ids += [0] * (pad * N)
        pos += list(range(N)) * pad
        slots += [-1] * (pad * N)
        seq += [N] * pad
        rows += [b * N for b in range(len(chunks), B)]
        table += [[0] * width] * pad
        for i in range(K - 1):
            dpos[i] += [N + i] * pad
            dslots[i] += [-1] * pad
            dseq[i] += [N + i + 1] * pad
        self.ext_ids[: B * N].copy_(torch.tensor(ids), non_blocking=True)
        self.ext_pos[: B * N].copy_(torch.tensor(pos), non_blocking=True)
        self.ext_slots[: B * N].copy_(torch.tensor(slots), non_blocking=True)
        self.ext_seq[:B].copy_(torch.tensor(seq, dtype=torch.int32), non_blocking=True)
        self.rows[:B].copy_(torch.tensor(rows), non_blocking=True)
        self.page_table[:B, :width].copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)
        batches[0].seq_lens_cpu[:] = seq  # host mirrors for the eager (reference backend) replay
        for i in range(K - 1):
            self.dec_pos[i, :B].copy_(torch.tensor(dpos[i]), non_blocking=True)
            self.dec_slots[i, :B].copy_(torch.tensor(dslots[i]), non_blocking=True)
            self.dec_seq[i, :B].copy_(torch.tensor(dseq[i], dtype=torch.int32), non_blocking=True)
            batches[1 + i].seq_lens_cpu[:] = dseq[i]

    @torch.inference_mode()
    def run(self, chunks) -> dict[str, list[int]]:
        """chunks: one per verified request, each with all N aux rows in `hidden`."""
        B = self.bucket(len(chunks))
        graph, batches, out = self.graphs[B]
        self._fill(B, batches, chunks)
        self.hidden[: len(chunks) * self.N].copy_(torch.cat([c.hidden for c in chunks]))
        if graph is not None:
            graph.replay()
        else:
            out = self._forward(B, batches)
        drafts = out[: len(chunks)].tolist()
        return {c.req.request_id: d for c, d in zip(chunks, drafts)}
