"""A test-only speculative proposer with known acceptance whose drafts stay on the device, so its verify steps
overlap (engine/spec_loop.py): REPLAY's drafts are chosen on the host and do not."""

import torch


def install_oracle(engine, prompts, outputs):
    """Put an OracleDraft around the engine's EAGLE3 proposer (the engine's and its loop's). Its drafts come from
    its own propose_verified, which the step graph (engine/spec_graph.py: the draft's step inside) would bypass, so
    the loop takes the launches."""
    oracle = OracleDraft(engine.proposer, prompts, outputs, engine.model_config.vocab_size)
    engine.proposer = oracle
    loop = getattr(engine.loop, "loop", engine.loop)  # the loop an OverlapLoop wraps
    loop.proposer, loop.step_graphs = oracle, None
    return oracle


class OracleDraft:
    """A test-only device proposer: each request's plain greedy continuation, looked up on the device from the
    verify's positions and accepted counts, with a deliberate miss at every position p with p % 5 == 0 (so steps
    accept 0..K tokens). The EAGLE3 draft's own steps still run beside it (their KV, their device step)."""

    def __init__(self, inner, prompts, outputs, vocab):
        self.inner, self.k, self.vocab = inner, inner.k, vocab
        width = max(len(p) + len(o) for p, o in zip(prompts, outputs)) + 4 * (self.k + 1)
        seqs = [p + o + [0] * (width - len(p) - len(o)) for p, o in zip(prompts, outputs)]
        self.table = torch.tensor(seqs, dtype=torch.int64, device=inner.device)  # [n, width]
        self.row = {tuple(p): i for i, p in enumerate(prompts)}

    def _drafts(self, rows: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """rows [B], first [B]: the first drafted position -> [B, K] drafts."""
        pos = first[:, None] + torch.arange(self.k, device=first.device)
        d = self.table[rows].gather(1, pos.clamp(max=self.table.shape[1] - 1))
        return torch.where(pos % 5 == 0, (d + 1) % self.vocab, d)

    def propose_verified(self, y, acc, hidden, reqs, starts=None, shift=None):
        if self.inner.propose_verified(y, acc, hidden, reqs, starts, shift) is None:
            return None
        dev = self.table.device
        starts = torch.tensor([r.num_computed_tokens for r in reqs] if starts is None else starts, device=dev)
        first = starts + (0 if shift is None else shift) + acc + 2  # y[acc] sits at start + 1 + acc
        rows = torch.tensor([self.row[tuple(r.prompt_token_ids)] for r in reqs], device=dev)
        return self._drafts(rows, first)

    def propose(self, chunks):
        out = self.inner.propose(chunks)
        for c in chunks:
            if c.propose:  # the chunk's last token sits at start + len(token_ids)
                first = torch.tensor([c.start + len(c.token_ids) + 1], device=self.table.device)
                rows = torch.tensor([self.row[tuple(c.req.prompt_token_ids)]], device=self.table.device)
                out[c.req.request_id] = self._drafts(rows, first)[0].tolist()
        return out
