"""A byte-level BPE tokenizer trained on the corpus with the `tokenizers` library, saved as tokenizer.json +
tokenizer_config.json (what mlaserve's and transformers' loaders read), and the corpus encoded with it into flat
uint16 token files: BOS, a file's tokens, EOS, the next file, ...
"""

from __future__ import annotations

import json
import os

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|bos|>", "<|eos|>"
ENCODE_BATCH = 512  # files per encode_batch call (the library spreads one call over its threads)


def train_bpe(texts, vocab_size: int) -> Tokenizer:
    """BPE over bytes (GPT-2's pre-tokenizer split), BOS id 0 and EOS id 1, `vocab_size` ids in all."""
    if not 512 <= vocab_size <= 65535:
        raise ValueError(f"--vocab-size: must be in [512, 65535] (token files are uint16), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if hasattr(texts, "__len__") else None)
    # add_special_tokens=True prepends BOS, as the model saw every file in training
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out: str, max_len: int) -> None:
    """tokenizer.json and tokenizer_config.json (PreTrainedTokenizerFast, BOS added, no chat template)."""
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def load_tokenizer(folder: str) -> Tokenizer:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer: {path} does not exist (run the tokenizer stage first)")
    return Tokenizer.from_file(path)


def encode_files(tok: Tokenizer, texts: list[str], path: str, progress=None) -> int:
    """Write BOS + ids + EOS of each text, in order, to `path` as uint16; -> the token count."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    n = 0
    with open(path + ".tmp", "wb") as f:
        for i in range(0, len(texts), ENCODE_BATCH):
            for enc in tok.encode_batch(texts[i : i + ENCODE_BATCH], add_special_tokens=False):
                ids = np.empty(len(enc.ids) + 2, dtype=np.uint16)
                ids[0], ids[1:-1], ids[-1] = bos, enc.ids, eos
                f.write(ids.tobytes())
                n += len(ids)
            if progress is not None:
                progress(min(i + ENCODE_BATCH, len(texts)))
    os.replace(path + ".tmp", path)
    return n
