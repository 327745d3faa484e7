"""Kimi's `tiktoken.model` (ranked byte tokens, Kimi's split regex, specials from tokenizer_config.json) as a
`tokenizers` byte-level BPE, so the rest of mlaserve sees one tokenizer type. No tiktoken needed at run time.

A merge list ordered by the rank of the merged token reproduces tiktoken's BPE (it always merges the pair whose
result ranks lowest). The conversion takes a few seconds for 160k tokens; the result is cached as tokenizer.json.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

# Kimi-K2 / K2.5's split pattern (tokenization_kimi.py); `&&` is class intersection, which oniguruma supports.
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


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """For each multi-byte token, the pair BPE (with only lower-ranked merges) joins last to form it."""
    out = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            out.append((parts[0], parts[1]))
    return out


def build(folder: str, byte_chars: dict[int, str]) -> HFTokenizer:
    """The folder's tiktoken.model + tokenizer_config.json's added_tokens_decoder -> a tokenizers.Tokenizer."""
    ranks = load_ranks(os.path.join(folder, "tiktoken.model"))
    text = lambda b: "".join(byte_chars[x] for x in b)  # noqa: E731  (GPT-2 byte-to-unicode form)
    vocab = {text(t): r for t, r in ranks.items()}
    merges = [(text(a), text(b)) for a, b in _merges(ranks)]
    tok = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PAT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    cfg_file = os.path.join(folder, "tokenizer_config.json")
    named = {}
    if os.path.isfile(cfg_file):
        with open(cfg_file, encoding="utf-8") as f:
            added = json.load(f).get("added_tokens_decoder") or {}
        named = {int(i): (v["content"] if isinstance(v, dict) else str(v)) for i, v in added.items()}
    base = len(ranks)
    specials = [
        AddedToken(named.get(i, f"<|reserved_token_{i}|>"), special=True, normalized=False)
        for i in range(base, base + NUM_RESERVED)
    ]
    tok.add_special_tokens(specials)  # ids base, base + 1, ... in order
    return tok


def load_cached(folder: str, byte_chars: dict[int, str], cache_dir: str) -> HFTokenizer:
    """build(), cached under cache_dir by the hash of the two input files."""
    h = hashlib.sha256()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                h.update(f.read())
    path = os.path.join(cache_dir, f"tiktoken-{h.hexdigest()[:24]}.json")
    if os.path.isfile(path):
        return HFTokenizer.from_file(path)
    tok = build(folder, byte_chars)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, path)
    return tok
