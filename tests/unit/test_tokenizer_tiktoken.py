"""Kimi's tiktoken.model folder tokenizes exactly as Kimi's tokenization_kimi.py does (tiktoken with Kimi's pattern,
the reserved ids named by added_tokens_decoder), on a >= 50k-rank file trained here on >= 1 MB of mixed text."""

import base64
import glob
import json
import os
import random
import sysconfig

import pytest

from mlaserve.tokenizer import Tokenizer, bytes_to_unicode

tiktoken = pytest.importorskip("tiktoken")
from tiktoken.load import load_tiktoken_bpe  # noqa: E402

# Written out here (not imported) so that a typo in mlaserve's copy fails the test.
KIMI_PAT_REF = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RANKS = 52_000
NAMED = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
NAMED += ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
NAMED += ["<think>", "</think>"]
NOT_SPECIAL = {"<think>", "</think>"}  # added tokens flagged "special": false are kept by skip_special_tokens


def _mixed_text(rng: random.Random, skip: int, nbytes: int) -> list[str]:
    """The machine's Python stdlib sources (every other file from `skip`), CJK, emoji, whitespace runs, numbers."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[skip::2]
    parts, size = [], 0
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            t = fh.read()
        parts.append(t)
        size += len(t.encode())
        if size > nbytes:
            break
    han = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)] + [chr(c) for c in range(0x3041, 0x3097)]
    n = nbytes // 100
    parts.append(
        "".join("".join(rng.choices(han, k=rng.randint(1, 12))) + rng.choice("，。！？、 \n") for _ in range(n))
    )
    emoji = ["🚀", "🔥", "👍🏽", "👨\u200d👩\u200d👧", "😀", "🇯🇵", "é", "ñ", " ", "\n", "Ωmega"]
    parts.append("".join(rng.choice(emoji) for _ in range(n)))
    runs = [" " * rng.randint(1, 40), "\t" * rng.randint(1, 5), "\n" * rng.randint(1, 4), "\r\n", "\u3000"]
    parts.append("".join(rng.choice(runs) + rng.choice(["x", "if", "1", "Ü"]) for _ in range(n)))
    parts.append(
        " ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) + rng.choice(["", ".5", "e3", "%"]) for _ in range(n))
    )
    return parts


@pytest.fixture(scope="session")
def kimi_folder(tmp_path_factory):
    """A byte-level BPE trained on ~1.4 MB, its merges as tiktoken ranks (bytes first, then merge order), and a
    tokenizer_config.json naming some of the 258 reserved ids as Kimi's does."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HF

    texts = _mixed_text(random.Random(0), 0, 1_000_000)
    assert sum(len(t.encode()) for t in texts) >= 1_000_000
    hf = HF(models.BPE())
    split = pre_tokenizers.Split(Regex(KIMI_PAT_REF), behavior="isolated")
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    hf.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=NUM_RANKS, show_progress=False, initial_alphabet=alphabet)
    )
    dec = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for m in json.loads(hf.to_str())["model"]["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m
        ranks.setdefault(bytes(dec[c] for c in a + b), len(ranks))
    assert len(ranks) >= 50_000
    folder = tmp_path_factory.mktemp("kimi")
    with open(folder / "tiktoken.model", "w") as f:
        for t, r in ranks.items():
            f.write(f"{base64.b64encode(t).decode()} {r}\n")
    base = len(ranks)
    named = {base + i: c for i, c in enumerate(NAMED)}
    cfg = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "added_tokens_decoder": {str(i): {"content": c, "special": c not in NOT_SPECIAL} for i, c in named.items()},
        "chat_template": "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder, named


def _kimi_reference(folder, named):
    """tokenization_kimi.py's construction: reserved ids base .. base + 257, unnamed ones <|reserved_token_i|>."""
    ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
    base = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + 256 + 2)}
    return tiktoken.Encoding("kimi-ref", pat_str=KIMI_PAT_REF, mergeable_ranks=ranks, special_tokens=specials), base


def _kimi_encode(enc, text: str) -> list[int]:
    """tokenization_kimi.py's encode: 400k-character slices, runs of > 25k (non-)whitespace cut, specials allowed."""
    out = []
    for i in range(0, len(text), 400_000):
        s = text[i : i + 400_000]
        run, space, start = 0, s[:1].isspace(), 0
        pieces = []
        for j, ch in enumerate(s):
            if ch.isspace() != space:
                run, space = 1, ch.isspace()
            else:
                run += 1
                if run > 25_000:
                    pieces.append(s[start:j])
                    start, run = j, 1
        pieces.append(s[start:])
        for p in pieces:
            out += enc.encode(p, allowed_special="all")
    return out


def test_large_rank_file_encodes_as_tiktoken(kimi_folder):
    folder, named = kimi_folder
    ref, base = _kimi_reference(folder, named)
    tok = Tokenizer.from_pretrained(str(folder))
    assert tok.vocab_size == base + 258 and tok.bos_token_id == base and tok.eos_token_ids[0] == base + 1
    # held-out text: the other half of the stdlib, fresh CJK / emoji / whitespace / numbers
    texts = _mixed_text(random.Random(1), 1, 300_000)
    rng = random.Random(2)
    specials = [*NAMED, f"<|reserved_token_{base + 100}|>"]
    texts += [
        "".join(rng.choice(["ab", " 你好", "\n\n", "🚀", "'s", "Ll9", ".,", " " * 3, *specials]) for _ in range(80))
    ]
    texts += ["a" * 30_000 + " " * 30_000 + "b", "", " ", "\r\n\r\n  \t"]
    for t in texts:
        ids = tok.encode(t)
        assert ids == _kimi_encode(ref, t), t[:200]
        assert tok.decode(ids, skip_special_tokens=False) == t
    assert tok.encode("[BOS]hi<|im_end|>") == [base, *ref.encode("hi"), base + 2]
    assert tok.encode("x", add_special_tokens=True) == ref.encode("x")  # Kimi adds no BOS


def test_special_flags_and_kept_markers(kimi_folder):
    folder, named = kimi_folder
    tok = Tokenizer.from_pretrained(str(folder))
    ids = {c: i for i, c in named.items()}
    seq = tok.encode("<think>why</think>so<|tool_call_begin|>f<|im_end|>")
    assert seq[0] == ids["<think>"] and seq[-1] == ids["<|im_end|>"]
    # "special": false tokens survive skip_special_tokens; special ones go unless kept
    assert tok.decode(seq) == "<think>why</think>sof"
    keep = frozenset({ids["<|tool_call_begin|>"]})
    assert tok.decode(seq, keep=keep) == "<think>why</think>so<|tool_call_begin|>f"
    assert tok.decode(seq, skip_special_tokens=False).endswith("f<|im_end|>")
    assert tok.backend.token_to_id("<|im_end|>") == ids["<|im_end|>"]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_user|>hi<|im_end|>"
