"""Structured output through xgrammar: a request's StructuredOutput compiled once (cached) against the tokenizer's
vocabulary, and per request a matcher that fills the step's token bitmask (layers/grammar_mask.py applies it to the
logits) and advances with each accepted token.

xgrammar is imported on the first structured request (it imports transformers): plain serving never pays for it.
Compiling runs wherever validate() is called; the server calls it off the event loop (warm) first.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch

from ..types import StructuredOutput

CACHE_SIZE = 256  # compiled grammars kept (each holds its token-mask cache)
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")  # "[12:00:00] /src/x.cc:12: "


def _why(e: Exception) -> str:
    """xgrammar's message without the C++ source location it starts with (no paths in a response)."""
    lines = [_CPP_PREFIX.sub("", x).strip() for x in str(e).strip().splitlines()]
    return next((x for x in lines if x), type(e).__name__)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose language is exactly the choices (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One request's matcher: fill its row of the step's bitmask, accept the sampled token. With `after` token ids
    the output is free (every token allowed, none fed to the matcher) up to and including the first of them."""

    def __init__(self, matcher, after: tuple[int, ...] = ()):
        self.matcher = matcher
        self.waiting = frozenset(after)  # empty once the grammar holds

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask [n, ceil(V / 32)] int32 on the CPU: bit t % 32 of word t // 32 set where token t is allowed."""
        if self.waiting:
            bitmask[row].fill_(-1)  # all bits set
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_chain(self, masks: torch.Tensor, tokens: list[int]) -> None:
        """masks [len(tokens) + 1, W] (CPU int32): row i the mask after tokens[:i] more (a verify's row i, after the
        drafts before it), in one pass, the matcher left as it was (fed, then rolled back). From a token the grammar
        refuses, or once it has ended, every later row allows everything: the verify rejects that draft, so no
        token is taken from those rows."""
        waiting, fed = self.waiting, 0
        try:
            for i in range(len(tokens) + 1):
                if waiting or self.matcher.is_terminated():  # free, or the stop token is among the tokens before
                    masks[i].fill_(-1)
                else:
                    self.matcher.fill_next_token_bitmask(masks, i)
                if i == len(tokens):
                    break
                t = tokens[i]
                if waiting:
                    waiting = frozenset() if t in waiting else waiting
                elif self.matcher.is_terminated() or not self.matcher.accept_token(t):
                    masks[i + 1 :].fill_(-1)
                    return
                else:
                    fed += 1
        finally:
            if fed:
                self.matcher.rollback(fed)

    def accept(self, token: int) -> bool:
        if self.waiting:
            if token in self.waiting:
                self.waiting = frozenset()
            return True
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and accepted a stop token: the request ends."""
        return not self.waiting and self.matcher.is_terminated()


class GrammarAhead:
    """A verify's view of a request's grammar (engine/spec_loop.py): the masks of its rows, row i's after the first i
    drafts (GrammarState.fill_chain, computed once, on the first row asked for); `row(i)` is what process_logits
    takes for row i, which it finds among the row's pending tokens (covers_pending: this mask has them)."""

    def __init__(self, state: GrammarState, drafts: list[int]):
        self.state, self.drafts = state, drafts
        self.masks: torch.Tensor | None = None

    def row(self, i: int) -> GrammarAheadRow:
        return GrammarAheadRow(self, i)

    def fill_row(self, i: int, bitmask: torch.Tensor, row: int) -> None:
        if self.masks is None:
            self.masks = torch.empty(len(self.drafts) + 1, bitmask.shape[1], dtype=bitmask.dtype)
            self.state.fill_chain(self.masks, self.drafts)
        bitmask[row].copy_(self.masks[min(i, len(self.drafts))])  # a row past the drafts: the mask after all


class GrammarAheadRow:
    """Row i of a verify under a grammar (GrammarAhead.row)."""

    covers_pending = True

    def __init__(self, ahead: GrammarAhead, i: int):
        self.ahead, self.i = ahead, i

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.ahead.fill_row(self.i, bitmask, row)


class GrammarCompiler:
    """The engine's grammar compiler over one tokenizer and the model's vocabulary (the logits' width)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler = None
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def _build(self):
        import xgrammar as xgr

        backend = self.tokenizer.backend
        vocab = [""] * self.vocab_size  # ids past the tokenizer's (lm_head padding) stay empty: never allowed
        for text, i in backend.get_vocab(with_added_tokens=True).items():
            if i < self.vocab_size:
                vocab[i] = text
        if hasattr(backend, "to_str"):  # a tokenizers (HF) backend: its decoder says how tokens spell text
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        else:  # tiktoken (tokenizer_tiktoken.py): get_vocab spells tokens in the GPT-2 byte-level form
            meta = {"vocab_type": xgr.VocabType.BYTE_LEVEL, "add_prefix_space": False}
        info = xgr.TokenizerInfo(
            vocab,
            meta["vocab_type"],
            vocab_size=self.vocab_size,
            stop_token_ids=self.stop_ids or None,
            add_prefix_space=meta["add_prefix_space"],
        )
        return xgr.GrammarCompiler(info, cache_enabled=False)  # cached here instead, bounded (CACHE_SIZE)

    def compile(self, so: StructuredOutput):
        """-> the compiled grammar (cached); ValueError naming so.field when it is invalid."""
        if self.tokenizer is None:
            raise ValueError(f"{so.field}: structured output needs a tokenizer; this model has none")
        key = (so.kind, so.spec, so.choices)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self._compiler is None:
                try:
                    self._compiler = self._build()
                except ImportError as e:
                    raise ValueError(f"{so.field}: structured output needs the xgrammar package ({e})") from None
        c = self._compiler
        try:
            if so.kind == "json":
                json.loads(so.spec)  # a clear message for text that is not JSON at all
                g = c.compile_json_schema(so.spec, any_whitespace=False)  # compact: no runs of blank space
            elif so.kind == "json_object":
                g = c.compile_json_schema('{"type": "object"}', any_whitespace=False)  # an object, not any value
            elif so.kind == "regex":
                g = c.compile_regex(so.spec)
            elif so.kind == "choice":
                g = c.compile_grammar(choice_grammar(so.choices))
            elif "::=" in so.spec:
                g = c.compile_grammar(so.spec)
            else:
                g = c.compile_lark(so.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"{so.field}: the JSON schema is not valid JSON ({e})") from None
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar"}.get(so.kind, so.kind)
            raise ValueError(f"{so.field}: invalid {what}: {_why(e)}") from None
        with self._lock:
            self._cache[key] = g
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return g

    def state(self, so: StructuredOutput) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(so)), so.after_token_ids)
