"""The grammar bitmask on the logits (layers/grammar_mask.py) against xgrammar's own CPU kernel on fresh random
masks, the bit order of a matcher's mask, and the fallback when other processors leave a row no allowed token."""

from __future__ import annotations

import pytest
import torch

from mlaserve.layers.grammar_mask import allowed_tokens, apply_bitmask, fill_bitmasks

xgr = pytest.importorskip("xgrammar")


@pytest.mark.parametrize("V", [31, 32, 512, 1000, 163840])
def test_matches_xgrammar_kernel(V):
    g = torch.Generator().manual_seed(V)
    B, W = 5, (V + 31) // 32
    bitmask = torch.randint(-(1 << 31), 1 << 31, (B, W), dtype=torch.int64, generator=g).to(torch.int32)
    bitmask[1] = 0  # a row that allows nothing
    bitmask[2] = -1  # a row that allows everything
    logits = torch.randn(B, V, generator=g)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask)
    ours = torch.full_like(logits, float("nan"))  # poisoned: every element must be written
    ours.copy_(logits)
    rows = [0, 1, 2, 3, 4]
    allowed = allowed_tokens(bitmask, V)
    assert allowed.shape == (B, V)
    apply_bitmask(ours, rows[:1] + rows[2:], bitmask[[0, 2, 3, 4]], logits)
    keep = [0, 2, 3, 4]
    assert torch.equal(ours[keep], ref[keep])
    assert torch.equal(ours[1], logits[1])  # a row not listed is untouched
    assert not ours.isnan().any()


def test_bit_order_from_a_matcher():
    """Bit t % 32 of word t // 32 is token t: a matcher allowing exactly three tokens."""
    V = 100
    vocab = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(V)]  # distinct strings: a..z, aa..zz, ...
    info = xgr.TokenizerInfo(vocab, vocab_size=V, stop_token_ids=[99])
    grammar = xgr.GrammarCompiler(info).compile_grammar('root ::= "c" | "aa" | "zzz"')

    class Row:
        def fill_bitmask(self, bm, row):
            xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bm, row)

    bm = fill_bitmasks([Row()], V, torch.device("cpu"))
    ids = allowed_tokens(bm, V)[0].nonzero().flatten().tolist()
    # "aa" can also start as "a" then "a"; "c"; "zzz" as z, zz or zzz
    assert set(ids) == {vocab.index(s) for s in ("a", "aa", "c", "z", "zz", "zzz")}


def test_stuck_row_takes_the_grammars_tokens():
    V = 64
    raw = torch.randn(2, V)
    processed = raw.clone()
    processed[0, :] = float("-inf")  # e.g. min_tokens masked the only tokens the grammar allows
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[:, 0] = 0b1010  # tokens 1 and 3
    apply_bitmask(processed, [0, 1], bitmask, raw)
    for r in range(2):
        assert torch.isinf(processed[r]).sum() == V - 2
        assert processed[r, 1] == raw[r, 1] and processed[r, 3] == raw[r, 3]
