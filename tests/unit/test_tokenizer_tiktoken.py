"""Kimi's tiktoken.model format converts to a byte-level BPE that encodes exactly as tiktoken does."""

import base64
import json
import random

import pytest

from mlaserve.tokenizer import Tokenizer
from mlaserve.tokenizer_tiktoken import KIMI_PAT, NUM_RESERVED

tiktoken = pytest.importorskip("tiktoken")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2026; we'll serve 8,192 tokens at 4.3 TB/s!",
    "Multi-head latent attention caches c_kv and k_pe: 576 values per token per layer.",
    "大规模语言模型推理引擎。你好，世界！月之暗面 Kimi 模型。",
    "def forward(self, x):\n    return self.down(self.act(self.gate(x)) * self.up(x))\n\n",
    "Ünïcödé, emoji 🚀🔥, accents café naïve — and    spaces\t\ttabs\r\nnewlines.",
] * 20


def _write_kimi_folder(folder):
    """Train a small byte-level BPE, write it as tiktoken ranks (rank = 256 + merge index) plus Kimi-style specials."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=600, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    from mlaserve.tokenizer import bytes_to_unicode

    dec = {c: b for b, c in bytes_to_unicode().items()}
    vocab = json.loads(hf.to_str())["model"]["vocab"]
    ranks = {bytes(dec[c] for c in tok): rank for tok, rank in vocab.items()}
    # tiktoken ranks must follow BPE order: bytes first (0..255 by byte value), then merges in training order.
    order = sorted(ranks, key=lambda t: (len(t) > 1, ranks[t] if len(t) > 1 else t[0]))
    ranks = {t: i for i, t in enumerate(order)}
    with open(folder / "tiktoken.model", "w") as f:
        for t, r in ranks.items():
            f.write(f"{base64.b64encode(t).decode()} {r}\n")
    base = len(ranks)
    specials = {base: "[BOS]", base + 1: "[EOS]", base + 2: "<|im_end|>", base + 3: "<|im_user|>"}
    cfg = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in specials.items()},
        "chat_template": "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return ranks, specials


def test_tiktoken_folder_matches_tiktoken(tmp_path, monkeypatch):
    monkeypatch.setenv("MLASERVE_CACHE", str(tmp_path / "cache"))
    ranks, specials = _write_kimi_folder(tmp_path)
    base = len(ranks)
    all_specials = {c: i for i, c in specials.items()}
    all_specials.update({f"<|reserved_token_{i}|>": i for i in range(base, base + NUM_RESERVED) if i not in specials})
    ref = tiktoken.Encoding("kimi-test", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=all_specials)
    tok = Tokenizer.from_pretrained(str(tmp_path))
    assert tok.vocab_size == base + NUM_RESERVED and tok.bos_token_id == base and base + 1 in tok.eos_token_ids
    rng = random.Random(0)
    texts = list(dict.fromkeys(CORPUS)) + [
        "".join(rng.choice("ab 你好\n🚀'sLl9.,") for _ in range(60)) for _ in range(50)
    ]
    for t in texts:
        assert tok.encode(t) == ref.encode(t, disallowed_special=()), t
        assert tok.decode(tok.encode(t)) == t
    assert tok.encode("[BOS]hi<|im_end|>") == [base] + ref.encode("hi", disallowed_special=()) + [base + 2]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_user|>hi<|im_end|>"
    # The conversion is cached: a second load reads the cached tokenizer.json.
    assert list((tmp_path / "cache" / "tokenizers").iterdir())
    assert Tokenizer.from_pretrained(str(tmp_path)).encode(texts[0]) == tok.encode(texts[0])
