"""The NGRAM proposer: prompt-lookup decoding (vLLM's "ngram" method, SGLang's NGRAM), with no draft model.

Each step a request's K draft tokens are what followed the latest earlier occurrence of its context's longest
suffix n-gram, n from prompt_lookup_max down to prompt_lookup_min, the context being its prompt and its output so
far. Where a request copies from its prompt (code edits, quoting, summaries, structured data) the verify accepts
the copied run; where nothing matches, the draft is the last token repeated and costs the verify's width only.
Drafts are chosen on the host after each step is read back (spec_loop.py's verified_drafts), as REPLAY's are.

A request with a prediction (OpenAI's Predicted Outputs: the output it expects, e.g. the file being edited) is also
looked up in the prediction (after the prompt's last tokens), which comes first at each n: the output's tail found
there is continued by the prediction, so an output that follows it is accepted K tokens a step, and one that leaves
it (an edit) is found again as soon as its last n tokens are back in the prediction.

A continuation shorter than K (a match near the end of the context) is padded with its last token.
"""

from __future__ import annotations

from ..types import Request


class NgramIndex:
    """One request's context with, for each n in [lo, hi], every n-gram -> the position after its latest
    occurrence that has a token after it (so the context's own suffix matches only an earlier occurrence)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.tokens: list[int] = []
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}

    def extend(self, tokens: list[int]) -> None:
        toks = self.tokens
        for t in tokens:
            p = len(toks)  # t's position: the n-grams ending at p - 1 now have a continuation
            for n, m in self.after.items():
                if p >= n:
                    m[tuple(toks[p - n : p])] = p
            toks.append(t)

    def lookup(self, k: int, first: NgramIndex | None = None) -> list[int] | None:
        """The k tokens after the latest earlier occurrence of the longest matching suffix of this context, or None;
        at each n, an occurrence in `first` (another sequence's index, same lo and hi) before one here."""
        toks, L = self.tokens, len(self.tokens)
        for n in range(min(self.hi, L), self.lo - 1, -1):
            key = tuple(toks[L - n :])
            for idx in (first, self) if first is not None else (self,):
                j = idx.after[n].get(key)
                if j is not None:
                    run = idx.tokens[j : j + k]  # j < len(idx.tokens): at least one token
                    return run + [run[-1]] * (k - len(run))
        return None


class NgramProposer:
    benchmark_only = False

    def __init__(self, spec, runner=None):
        self.k = spec.num_steps
        self.lo, self.hi = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.index: dict[str, tuple[Request, NgramIndex, NgramIndex | None]] = {}  # context, prediction
        self.proposed_tokens = self.matched_tokens = 0  # draft tokens proposed; of those, from a match

    def tokens(self, req: Request) -> list[int]:
        """The K draft tokens after req's context (its prompt and output so far)."""
        entry = self.index.get(req.request_id)
        if entry is None or entry[0] is not req:
            if len(self.index) > 64:  # forget finished requests (an index holds each n-gram of a context)
                self.index = {k: v for k, v in self.index.items() if not v[0].finished}
            pred = None
            if req.prediction_token_ids:
                pred = NgramIndex(self.lo, self.hi)  # after the prompt's last hi - 1 tokens: n-grams across the join
                prompt = req.prompt_token_ids
                pred.extend(prompt[max(0, len(prompt) - self.hi + 1) :] + req.prediction_token_ids)
            entry = self.index[req.request_id] = (req, NgramIndex(self.lo, self.hi), pred)
        idx = entry[1]
        p, n = len(req.prompt_token_ids), len(idx.tokens)
        if n < p:
            idx.extend(req.prompt_token_ids[n:])
            n = p
        idx.extend(req.output_token_ids[n - p :])
        self.proposed_tokens += self.k
        run = idx.lookup(self.k, entry[2])
        if run is None:
            return [idx.tokens[-1]] * self.k
        self.matched_tokens += self.k
        return run

    def propose_verified(self, y, acc, hidden, reqs, starts=None, shift=None):
        """Nothing to draft on the device ([B, 0]): the drafts are chosen once the step is read back."""
        return y.new_empty((y.shape[0], 0))

    def verified_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        return self.tokens(req)

    def propose(self, chunks) -> dict[str, list[int]]:
        return {c.req.request_id: self.tokens(c.req) for c in chunks if c.propose}
