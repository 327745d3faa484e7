"""Random token-id prompts from a seed: the same seed, vocabulary and exclusions give the same prompts, each exactly
input-len tokens long, after a shared prefix of prefix-len tokens where one is asked for."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

DEFAULT_VOCAB_SIZE = 32000  # when neither --vocab-size nor the server says: safe for any modern tokenizer

# numpy streams: prompts use Generator(seed) itself; the others are independent of it
WARMUP_STREAM, ARRIVAL_STREAM, PREFIX_STREAM, WARMUP_PREFIX_STREAM = 1, 2, 3, 4


def random_prompts(
    num_prompts: int, input_len: int, seed: int, vocab_size: int, exclude: Iterable[int] = (), stream: int | None = None
) -> np.ndarray:
    """[num_prompts, input_len] int64 token ids drawn uniformly from [0, vocab_size) minus `exclude`."""
    if num_prompts < 0 or input_len < 1:
        raise ValueError(f"num_prompts must be >= 0 and input_len >= 1, got {num_prompts} and {input_len}")
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(sorted(set(exclude)), dtype=np.int64))
    if len(allowed) == 0:
        raise ValueError(f"vocab_size {vocab_size} minus the excluded ids leaves no token to draw")
    rng = np.random.default_rng(seed if stream is None else [seed, stream])
    return allowed[rng.integers(0, len(allowed), size=(num_prompts, input_len))]  # [N, L]


def with_shared_prefix(
    prompts: np.ndarray, prefix_len: int, seed: int, vocab_size: int, exclude: Iterable[int] = (), stream: int = 0
) -> np.ndarray:
    """[N, L] -> [N, prefix_len + L]: one random prefix (from its own stream) before every prompt; prefix_len 0: the
    prompts as they are."""
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    if prefix_len == 0:
        return prompts
    prefix = random_prompts(1, prefix_len, seed, vocab_size, exclude, stream=stream or PREFIX_STREAM)  # [1, P]
    return np.concatenate([np.repeat(prefix, len(prompts), axis=0), prompts], axis=1)


def prompts_sha256(prompts: np.ndarray) -> str:
    """Digest of the prompt ids (little-endian int64), so compare can prove both sides sent the same prompts."""
    return hashlib.sha256(np.ascontiguousarray(prompts, dtype="<i8").tobytes()).hexdigest()


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: exponential gaps at `rate` req/s; all zero when rate is inf."""
    if rate == float("inf"):
        return [0.0] * num
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    gaps = np.random.default_rng([seed, ARRIVAL_STREAM]).exponential(1.0 / rate, size=num)
    return np.cumsum(gaps).tolist()


def special_ids_from_card(card: dict) -> list[int]:
    """Special-token ids a /v1/models entry advertises: `special_token_ids`, `bos_token_id`, `eos_token_id(s)`,
    `pad_token_id` (mlaserve extensions; vLLM and SGLang send none of them)."""
    ids: set[int] = set()
    for key in ("special_token_ids", "bos_token_id", "eos_token_id", "eos_token_ids", "pad_token_id"):
        v = card.get(key)
        vals = v if isinstance(v, list) else [v]
        ids.update(int(x) for x in vals if isinstance(x, int) and not isinstance(x, bool))
    return sorted(ids)
