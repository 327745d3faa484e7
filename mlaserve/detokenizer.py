"""Incremental detokenization: stream whole characters only, and cut at stop strings (vLLM semantics).

Each step decodes a small window (prefix/read offsets, as vLLM and TGI do), never the whole sequence.
"""

from __future__ import annotations

from collections.abc import Iterable

from .tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a decode of a half character ends with


class IncrementalDetokenizer:
    """Turns one request's generated ids into text as they arrive.

    `step(ids)` returns (new text, matched stop string or None). Text that might still be a half character or
    the start of a stop string is held back; `flush()` releases it when the request ends for another reason.
    """

    PROMPT_CONTEXT = 5  # prompt tokens decoded before the first new one, so its leading space/bytes come out right
    MAX_PENDING = 8  # tokens a half character may hold back before they are forced out (as U+FFFD): garbage bytes
    TRIM_AT = 1024  # drop ids this far behind the window

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_ids: list[int],
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        keep_special_token_ids: frozenset[int] = frozenset(),
    ):
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop: stop strings must be non-empty strings")
        if tokenizer is None and stop:
            raise ValueError("stop: stop strings need a tokenizer; this model has none")
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.keep = frozenset(keep_special_token_ids)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._ids = list(prompt_ids[-self.PROMPT_CONTEXT :]) if tokenizer is not None else []
        self._prefix = 0  # ids[prefix:read] were decoded last time: context for the next decode
        self._read = len(self._ids)  # ids[read:] are not yet turned into text
        self._held = ""  # decoded, not emitted: may be the start of a stop string
        self.text = ""  # everything emitted so far
        self.stop_reason: str | None = None  # the stop string that ended the request
        self.finished = False

    def step(self, new_ids: list[int]) -> tuple[str, str | None]:
        """Add generated ids; return the text they complete and the stop string matched (then the request ends)."""
        if self.tokenizer is None or self.finished:
            return "", None
        self._ids.extend(new_ids)
        return self._emit(self._advance(force=False), final=False)

    def flush(self) -> tuple[str, str | None]:
        """The request ended (eos, length): emit what was held back, a trailing half character as U+FFFD."""
        if self.tokenizer is None or self.finished:
            return "", None
        out = self._emit(self._advance(force=True), final=True)
        self.finished = True
        return out

    # ---- ids -> whole characters ------------------------------------------------------------------------------
    def _decode(self, start: int, end: int) -> str:
        ids = self._ids[start:end]
        if self.keep:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, keep=self.keep)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, force: bool) -> str:
        """Decode the pending ids; return the new text up to the last whole character."""
        n = len(self._ids)
        if self._read == n:
            return ""
        full = self._decode(self._prefix, n)
        cut = n
        if full.endswith(REPLACEMENT) and not force:
            # A half character starts in one of the last 3 tokens (4 bytes at most, each token >= 1 byte):
            # emit up to a token boundary before it, if one gives whole characters.
            cut = None
            for c in range(n - 1, max(self._read, n - 4), -1):
                text = self._decode(self._prefix, c)
                if not text.endswith(REPLACEMENT):
                    cut, full = c, text
                    break
            if cut is None:
                if n - self._read < self.MAX_PENDING:
                    return ""
                cut = n - 3  # bytes that never form a character: give them out, keep what may still complete
                full = self._decode(self._prefix, cut)
        new = full[len(self._decode(self._prefix, self._read)) :]
        self._prefix, self._read = self._read, cut
        if self._prefix >= self.TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return new

    # ---- stop strings -----------------------------------------------------------------------------------------
    def _emit(self, new: str, final: bool) -> tuple[str, str | None]:
        buf = self._held + new
        # Emitted text never holds the start of a stop string (see the hold below), so search only buf.
        # Of several matches, the one that ends first wins, as it would have token by token.
        best = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
                best = (i, s)
        if best is not None:
            i, s = best
            out = buf[: i + len(s) if self.include_stop_str_in_output else i]
            self.text += out
            self._held = ""
            self.stop_reason, self.finished = s, True
            return out, s
        hold = 0 if final else self._stop_prefix_len(buf)
        out, self._held = buf[: len(buf) - hold], buf[len(buf) - hold :]
        self.text += out
        return out, None

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
