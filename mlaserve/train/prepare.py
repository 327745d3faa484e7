"""The recipe's data stages in a work folder: corpus/manifest.json, tokenizer/ (BPE), corpus/train.bin and
corpus/held_out.bin (uint16 tokens) with corpus/tokens.json (their counts). A stage whose output exists is reused."""

from __future__ import annotations

import json
import logging
import os
import time

from .bpe import encode_files, load_tokenizer, save_tokenizer, train_bpe
from .corpus import MAX_FILE_BYTES, default_roots, read_manifest, read_texts, scan, write_manifest

log = logging.getLogger("mlaserve.train")


class Corpus:
    """The manifest and, read once on demand, the texts of its two splits."""

    def __init__(self, work: str, workers: int):
        self.dir = os.path.join(work, "corpus")
        self.manifest_path = os.path.join(self.dir, "manifest.json")
        self.workers = workers
        self.manifest: dict | None = None
        self.files = None
        self._texts: dict[str, list[str]] = {}

    def build(self, roots: list[str] | None, manifest: str | None, max_mb: float | None, held_out_mod: int) -> dict:
        """From `manifest` (+ roots), else by scanning roots (default: stdlib and site-packages)."""
        os.makedirs(self.dir, exist_ok=True)
        t = time.monotonic()
        if manifest:
            m, files = read_manifest(manifest, roots)
            self.manifest, self.files = m, files
            texts = read_texts(m["roots"], files, self.workers)  # every hash checked before it is used
            self._split(texts)
            write_manifest(self.manifest_path, m["roots"], files, m["settings"])
        else:
            roots = [os.path.realpath(r) for r in roots] if roots else default_roots()
            for r in roots:
                if not os.path.isdir(r):
                    raise ValueError(f"--roots: {r} is not a folder")
            max_bytes = int(max_mb * 1e6) if max_mb else None
            files = scan(roots, max_bytes, self.workers)
            if not files:
                raise ValueError(f"corpus: no .py files under {roots}")
            settings = {
                "max_corpus_bytes": max_bytes,
                "max_file_bytes": MAX_FILE_BYTES,
                "dedup": "sha256 of the bytes",
                "held_out_mod": held_out_mod,
            }
            self.manifest, self.files = write_manifest(self.manifest_path, roots, files, settings), files
        m = self.manifest
        if not m["held_out_files"] or m["held_out_files"] == m["num_files"]:
            raise ValueError(
                f"corpus: {m['held_out_files']} of {m['num_files']} files held out; both splits need files "
                "(more files, or another --held-out-mod)"
            )
        log.info(
            "corpus: %d files, %.1f MB (%d held out), manifest %s, %.1f s",
            m["num_files"],
            m["bytes"] / 1e6,
            m["held_out_files"],
            m["sha256"][:16],
            time.monotonic() - t,
        )
        return m

    def load(self) -> dict:
        if self.manifest is None:
            self.manifest, self.files = read_manifest(self.manifest_path)
        return self.manifest

    def _split(self, texts: list[str]) -> None:
        self._texts = {"train": [], "held_out": []}
        mod = self.manifest["settings"]["held_out_mod"]
        for f, t in zip(self.files, texts):
            self._texts["held_out" if f.held_out(mod) else "train"].append(t)

    def texts(self, split: str) -> list[str]:
        """ "train" or "held_out": the split's texts in manifest (hash) order."""
        if not self._texts:
            m = self.load()
            self._split(read_texts(m["roots"], self.files, self.workers))
        return self._texts[split]

    @property
    def exists(self) -> bool:
        return os.path.isfile(self.manifest_path)


def build_tokenizer(corpus: Corpus, out: str, vocab_size: int, sample_mb: float, max_len: int) -> None:
    """BPE trained on the first training files (hash order) up to sample_mb megabytes."""
    t = time.monotonic()
    sample, total = [], 0
    for text in corpus.texts("train"):
        if total >= sample_mb * 1e6:
            break
        sample.append(text)
        total += len(text)
    tok = train_bpe(sample, vocab_size)
    save_tokenizer(tok, out, max_len)
    log.info("tokenizer: %d ids from %.1f MB, %.1f s", tok.get_vocab_size(), total / 1e6, time.monotonic() - t)


def build_tokens(corpus: Corpus, tokenizer_dir: str) -> dict:
    """corpus/train.bin, corpus/held_out.bin and corpus/tokens.json."""
    t = time.monotonic()
    tok = load_tokenizer(tokenizer_dir)
    counts = {}
    for split in ("train", "held_out"):
        counts[split] = encode_files(tok, corpus.texts(split), os.path.join(corpus.dir, f"{split}.bin"))
    m = corpus.load()
    info = {
        "manifest_sha256": m["sha256"],
        "train_tokens": counts["train"],
        "held_out_tokens": counts["held_out"],
        "held_out_bytes": m["held_out_bytes"],
        "bytes_per_token": (m["bytes"] - m["held_out_bytes"]) / max(counts["train"], 1),
    }
    with open(os.path.join(corpus.dir, "tokens.json"), "w") as f:
        json.dump(info, f, indent=1)
    log.info(
        "tokens: %d train, %d held out (%.2f bytes/token), %.1f s",
        counts["train"],
        counts["held_out"],
        info["bytes_per_token"],
        time.monotonic() - t,
    )
    return info


def read_token_info(corpus: Corpus) -> dict | None:
    path = os.path.join(corpus.dir, "tokens.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        info = json.load(f)
    return info if info.get("manifest_sha256") == corpus.load()["sha256"] else None
