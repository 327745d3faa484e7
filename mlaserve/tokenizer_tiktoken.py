"""Kimi's `tiktoken.model` through the `tiktoken` library, exactly as Kimi's own tokenization_kimi.py builds it:
its split pattern, the ranked byte tokens, and 256 + 2 reserved ids after them named by tokenizer_config.json's
added_tokens_decoder. `TiktokenBackend` offers the part of `tokenizers.Tokenizer`'s interface mlaserve uses.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass

from tokenizers import AddedToken

# Kimi-K2 / K2.5's split pattern (tokenization_kimi.py); `&&` is class intersection.
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED = 256 + 2  # special ids after the base vocabulary, as Kimi's tokenizer reserves them
MAX_ENCODE_CHARS = 400_000  # tokenization_kimi.py encodes in slices of this many characters
MAX_RUN_CHARS = 25_000  # ... and cuts runs of whitespace / non-whitespace longer than this


def load_ranks(file: str) -> dict[bytes, int]:
    """tiktoken's format: one `base64(token) rank` per line."""
    ranks = {}
    with open(file, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
            except ValueError:
                raise ValueError(f"{file}: line {n} is not 'base64-token rank'") from None
    return ranks


def _runs(s: str, limit: int):
    """tokenization_kimi.py's _split_whitespaces_or_nonwhitespaces: no piece holds more than `limit` consecutive
    whitespace or non-whitespace characters."""
    run, is_space, start = 0, s[:1].isspace(), 0
    for i, ch in enumerate(s):
        now = ch.isspace()
        if now != is_space:
            run, is_space = 1, now
        else:
            run += 1
            if run > limit:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


@dataclass
class _Encoding:
    ids: list[int]


class TiktokenBackend:
    """A folder's tiktoken.model + tokenizer_config.json as a tiktoken.Encoding, with the `tokenizers.Tokenizer`
    methods mlaserve calls (encode().ids, decode, token_to_id, get_vocab, get_added_tokens_decoder, sizes)."""

    def __init__(self, folder: str, byte_chars: dict[int, str]):
        import tiktoken

        ranks = load_ranks(os.path.join(folder, "tiktoken.model"))
        cfg_file = os.path.join(folder, "tokenizer_config.json")
        added = {}
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                added = json.load(f).get("added_tokens_decoder") or {}
        named = {int(i): (v if isinstance(v, dict) else {"content": str(v)}) for i, v in added.items()}
        base = len(ranks)
        self.base = base
        self.specials: dict[str, int] = {}
        self.added: dict[int, AddedToken] = {}
        for i in range(base, base + NUM_RESERVED):
            entry = named.get(i, {})
            content = entry.get("content") or f"<|reserved_token_{i}|>"
            self.specials[content] = i
            # the config's "special" flag decides what skip_special_tokens drops (unnamed reserved ids: special)
            self.added[i] = AddedToken(content, special=bool(entry.get("special", True)), normalized=False)
        self.special_ids = frozenset(i for i, t in self.added.items() if t.special)
        self.enc = tiktoken.Encoding(
            name=os.path.basename(os.path.normpath(folder)),
            pat_str=KIMI_PAT,
            mergeable_ranks=ranks,
            special_tokens=self.specials,
        )
        self._byte_chars = byte_chars
        self._ranks = ranks

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        """As Kimi's encode: special-token text in `text` becomes its id; no BOS (Kimi adds none)."""
        ids: list[int] = []
        for i in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in _runs(text[i : i + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
                ids += self.enc.encode(piece, allowed_special="all")
        return _Encoding(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self.enc.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_batch(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.base + NUM_RESERVED if with_added_tokens else self.base

    def token_to_id(self, token: str) -> int | None:
        """A special token's text, or a base token in the GPT-2 byte-to-unicode form tokenizers uses."""
        if token in self.specials:
            return self.specials[token]
        inverse = {c: b for b, c in self._byte_chars.items()}
        if not all(c in inverse for c in token):
            return None
        return self._ranks.get(bytes(inverse[c] for c in token))

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        out = {"".join(self._byte_chars[b] for b in t): r for t, r in self._ranks.items()}
        if with_added_tokens:
            out.update(self.specials)
        return out

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self.added)
