"""IncrementalDetokenizer: whole characters only, stop strings with vLLM semantics, bounded work per step."""

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from mlaserve.detokenizer import IncrementalDetokenizer
from mlaserve.tokenizer import Tokenizer, write_byte_level_tokenizer

PROMPT = [256, 104, 105]  # <|bos|>hi


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("bytetok"))
    write_byte_level_tokenizer(d, 512, 256, 257)
    return Tokenizer.from_pretrained(d)


def chunked(ids, rng):
    i = 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        yield ids[i : i + n]
        i += n


def stream(detok, ids, rng=None, flush=True):
    """Feed ids (one at a time, or in random chunks); return the pieces and the stop string matched."""
    pieces, stop = [], None
    for chunk in chunked(ids, rng) if rng else ([i] for i in ids):
        piece, stop = detok.step(chunk)
        pieces.append(piece)
        if stop is not None:
            return pieces, stop
    if flush:
        piece, stop = detok.flush()
        pieces.append(piece)
    return pieces, stop


MULTIBYTE = ["世界你好", "🎉🚀 party", "👩‍👩‍👧‍👦", "日本語 and English é ü", "a\U0010ffffb", "é\u0301", "\ufffd ok"]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_never_split(tok, text):
    ids = tok.encode(text)
    for rng in (None, random.Random(0), random.Random(1)):
        d = IncrementalDetokenizer(tok, PROMPT)
        pieces, stop = stream(d, ids, rng, flush=False)
        assert stop is None
        # Every piece is whole characters: no U+FFFD appears that the text itself does not have.
        assert sum(p.count("\ufffd") for p in pieces) == text.count("\ufffd")
        assert "".join(pieces) == d.text == tok.decode(ids) == text  # nothing left held back at the end
        assert d.flush() == ("", None)


def test_partial_character_is_held(tok):
    d = IncrementalDetokenizer(tok, PROMPT)
    a, b, c = tok.encode("世")
    assert d.step([a]) == ("", None)
    assert d.step([b]) == ("", None)
    assert d.step([c]) == ("世", None)
    e = tok.encode("🎉")
    assert d.step(e[:3]) == ("", None)
    assert d.step(e[3:] + tok.encode("x")) == ("🎉x", None)


def test_random_ids_match_full_decode(tok):
    """Random ids (invalid byte runs, fillers, specials): text after flush equals the full decode."""
    rng = random.Random(2)
    for trial in range(200):
        weights_high_bytes = trial % 2 == 0
        ids = [
            rng.randrange(128, 256) if weights_high_bytes and rng.random() < 0.8 else rng.randrange(512)
            for _ in range(rng.randint(1, 40))
        ]
        d = IncrementalDetokenizer(tok, PROMPT)
        pieces, _ = stream(d, ids, rng if trial % 3 else None)
        assert "".join(pieces) == d.text == tok.decode(ids)


def test_garbage_bytes_do_not_pile_up(tok):
    d = IncrementalDetokenizer(tok, PROMPT)
    out = "".join(d.step([0xE4])[0] for _ in range(50))
    assert len(d._ids) - d._read < d.MAX_PENDING
    assert out and set(out) == {"\ufffd"}
    d.flush()
    assert d.text == tok.decode([0xE4] * 50)


def test_work_per_step_is_bounded(tok):
    """Each step decodes a small window, not the whole sequence: total decoded ids grow linearly."""
    decoded = [0]

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded[0] += len(ids)
            return tok.decode(ids, skip_special_tokens)

    text = "世界 hello 🎉 " * 500
    ids = tok.encode(text)
    d = IncrementalDetokenizer(Counting(), PROMPT, stop=["never matches"])
    stream(d, ids, random.Random(3))
    assert d.text == text
    assert decoded[0] < 12 * len(ids)


def test_prompt_context_keeps_leading_space():
    """With a Metaspace (SentencePiece-style) decoder, a first token's leading space survives thanks to the prompt."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    t = Tokenizer(backend)
    assert t.decode([2]) == "world" and t.decode([1, 2]) == "hello world"
    d = IncrementalDetokenizer(t, [1])
    assert d.step([2]) == (" world", None)
    assert d.step([3]) == ("!", None)
    d = IncrementalDetokenizer(t, [])
    assert d.step([2]) == ("world", None)


# ---- stop strings ---------------------------------------------------------------------------------------------------


def run_stop(tok, text, stop, include=False, rng=None, prompt=PROMPT):
    d = IncrementalDetokenizer(tok, prompt, stop=stop, include_stop_str_in_output=include)
    pieces, matched = stream(d, tok.encode(text), rng)
    assert "".join(pieces) == d.text
    return d.text, matched


def test_stop_across_token_boundaries(tok):
    for rng in (None, random.Random(4)):
        assert run_stop(tok, "hello world! more", ["world"], rng=rng) == ("hello ", "world")
        assert run_stop(tok, "hello world! more", ["world"], include=True, rng=rng) == ("hello world", "world")
        assert run_stop(tok, "价格是世界第一", ["世界"], rng=rng) == ("价格是", "世界")  # multi-byte stop


def test_stop_at_the_very_start(tok):
    d = IncrementalDetokenizer(tok, PROMPT, stop=["ab"])
    assert d.step(tok.encode("a")) == ("", None)
    assert d.step(tok.encode("bcd")) == ("", "ab")
    assert d.text == "" and d.finished and d.stop_reason == "ab"
    assert d.step(tok.encode("more")) == ("", None)  # finished: nothing more
    assert run_stop(tok, "abc", ["ab"], include=True) == ("ab", "ab")


def test_overlapping_candidates(tok):
    assert run_stop(tok, "xabcd", ["abc", "bcd"]) == ("x", "abc")
    assert run_stop(tok, "xabcd", ["bcd", "abc"]) == ("x", "abc")  # the first to end wins, not list order
    assert run_stop(tok, "xabcdef", ["abcdef", "cd"]) == ("xab", "cd")
    assert run_stop(tok, "aaab", ["aab"]) == ("a", "aab")  # self-overlapping
    assert run_stop(tok, "xab", ["ab", "b"]) == ("x", "ab")  # same end: the earlier start
    # Several tokens in one step: the stop and text after it arrive together
    d = IncrementalDetokenizer(tok, PROMPT, stop=["STOP"])
    assert d.step(tok.encode("one STOP two")) == ("one ", "STOP")


def test_held_prefix_is_released(tok):
    d = IncrementalDetokenizer(tok, PROMPT, stop=["world"])
    assert d.step(tok.encode("hello wor")) == ("hello ", None)
    assert d.step(tok.encode("m")) == ("worm", None)
    assert d.step(tok.encode(" wo")) == (" ", None)
    assert d.flush() == ("wo", None)  # the request ended another way: the held text goes out
    assert d.text == "hello worm wo"


def test_prompt_is_not_searched(tok):
    prompt = tok.encode("say STOP", add_special_tokens=True)
    assert run_stop(tok, "P now", ["STOP", "OP"], prompt=prompt) == ("P now", None)


def test_stop_random_against_reference(tok):
    """Random texts, stops and chunkings: emitted text only grows, and the result is the reference cut."""
    rng = random.Random(5)
    alphabet = "ab 世🎉"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5
        hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if hits:
            end, start, s = min(hits)
            want = (text[: end if include else start], s)
        else:
            want = (text, None)
        assert run_stop(tok, text, stops, include, rng) == want, (text, stops)
        # No piece ever contains a stop string (unless included, then only at the very end)
        d = IncrementalDetokenizer(tok, PROMPT, stop=stops)
        pieces, _ = stream(d, tok.encode(text), rng)
        assert not any(s in d.text for s in stops)


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nhi<|im_end|>") + [257]
    d = IncrementalDetokenizer(tok, PROMPT)
    stream(d, ids)
    assert d.text == "assistant\nhi"
    d = IncrementalDetokenizer(tok, PROMPT, skip_special_tokens=False, stop=["<|im_end|>"])
    pieces, stop = stream(d, ids)
    assert (d.text, stop) == ("<|im_start|>assistant\nhi", "<|im_end|>")


def test_without_tokenizer():
    d = IncrementalDetokenizer(None, [1, 2, 3])
    assert d.step([4, 5]) == ("", None)
    assert d.flush() == ("", None)
    assert d.text == ""
    with pytest.raises(ValueError, match=r"^stop: stop strings need a tokenizer; this model has none$"):
        IncrementalDetokenizer(None, [1], stop=["x"])
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(None, [1], stop=[""])


def test_stop_strings_checked_and_a_single_string_is_one_stop(tok):
    for bad in ([""], ["ok", ""], [3]):
        with pytest.raises(ValueError, match="^stop: stop strings must be non-empty strings$"):
            IncrementalDetokenizer(tok, PROMPT, stop=bad)
    d = IncrementalDetokenizer(tok, PROMPT, stop="ab")  # one stop string, not the stops "a" and "b"
    assert d.step(tok.encode("xa b ab")) == ("xa b ", "ab")


def test_state_after_an_end_without_a_stop(tok):
    d = IncrementalDetokenizer(tok, PROMPT, stop=["zzz"])
    assert d.stop_reason is None and d.finished is False
    d.step(tok.encode("hello"))
    assert d.flush() == ("", None)
    assert d.finished is True and d.stop_reason is None
    assert d.step(tok.encode("more")) == ("", None) and d.flush() == ("", None)  # ended: nothing more, ever
