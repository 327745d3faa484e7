"""Training data for a distilled draft: prompts (read, or random token prefixes), the target's greedy continuations
(mlaserve's own engine), and per sequence the target's aux hidden states and greedy next tokens."""

from __future__ import annotations

import json
import random

import torch

from ..attention.base import SeqChunk
from ..layers.sampler import greedy_tokens
from ..types import SamplingParams


def read_prompts(path: str, tokenizer) -> list[list[int]]:
    """A .jsonl file (one JSON value a line: a string, a list of ids, or an object with "prompt", "text" or
    "prompt_token_ids") or a text file (one prompt a line) -> token ids."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            value = line
            if path.endswith(".jsonl"):
                try:
                    value = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"--prompts: {path} line {n} is not JSON ({e})") from e
                if isinstance(value, dict):
                    value = next((value[k] for k in ("prompt_token_ids", "prompt", "text") if k in value), None)
            if isinstance(value, list) and all(isinstance(t, int) for t in value):
                out.append(value)
            elif isinstance(value, str):
                if tokenizer is None:
                    raise ValueError(f"--prompts: {path} line {n} is text, and the target has no tokenizer")
                out.append(tokenizer.encode(value, add_special_tokens=True))
            else:
                raise ValueError(f"--prompts: {path} line {n}: expected text, token ids, or an object with a prompt")
    if not out:
        raise ValueError(f"--prompts: {path} holds no prompt")
    return out


def random_prompts(n: int, vocab: int, max_len: int, seed: int, exclude=()) -> list[list[int]]:
    """n random token prefixes of 1 .. 3/4 max_len tokens, drawn from the vocabulary less `exclude`. Long prefixes
    are cheap labels (one prefill gives the target's greedy token at every position) that cover the vocabulary."""
    rng = random.Random(seed)
    ids = sorted(set(range(vocab)) - set(exclude))
    return [[rng.choice(ids) for _ in range(rng.randint(1, max(1, max_len * 3 // 4)))] for _ in range(n)]


def corpus_prompts(path: str, n: int, max_len: int, seed: int, bos: int | None) -> list[list[int]]:
    """n windows of a uint16 token file (a train-model corpus split), each 8 .. max_len / 2 tokens long at a seeded
    random position, BOS first as a served prompt has it: the target continues real text, so the draft learns the
    contexts it will see."""
    import numpy as np

    tokens = np.fromfile(path, dtype=np.uint16)
    hi = max(8, max_len // 2)
    if len(tokens) <= hi:
        raise ValueError(f"--corpus: {path} holds {len(tokens)} tokens; a prompt window needs more than {hi}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(8, hi)
        start = rng.randrange(len(tokens) - k)
        window = tokens[start : start + k].tolist()
        out.append(([bos] if bos is not None else []) + window)
    return out


def greedy_sequences(llm, prompts: list[list[int]], max_len: int, progress: bool = True) -> list[list[int]]:
    """Each prompt (cut to max_len - 1 tokens) followed by the target's greedy continuation up to max_len tokens."""
    prompts = [p[: max_len - 1] for p in prompts]
    out = []
    for i in range(0, len(prompts), 512):  # the engine queues at most max_queue_len requests
        part = prompts[i : i + 512]
        params = [SamplingParams(temperature=0, max_tokens=max_len - len(p)) for p in part]
        out += [p + o.token_ids for p, o in zip(part, llm.generate(part, params, use_tqdm=progress))]
    return out


class TargetFeatures:
    """The target's aux hidden states [L, 3D] and greedy next tokens [L] of whole sequences, by one prefill forward
    each on the engine's runner (its pages taken from the engine's pool), kept on the host while `budget` bytes
    last and recomputed after."""

    def __init__(self, engine, aux_ids: tuple[int, ...], budget: int):
        self.engine, self.budget, self.used = engine, budget, 0
        self.runner = engine.runner
        self.runner.model.aux_layer_ids = aux_ids
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def _forward(self, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.engine.pool
        pages = pool.allocate(pool.pages_for(len(seq)))
        if pages is None:
            raise ValueError(f"--max-len: a {len(seq)}-token sequence needs more KV pages than the target's cache has")
        try:
            batch = self.runner.build_batch([], [SeqChunk(seq, 0, pages, "all")])
            hidden, aux = self.runner.model(batch.input_ids, batch.positions, batch)
            nxt = greedy_tokens(self.runner.model.compute_logits(hidden).contiguous(), self.runner.kernels.pdl)
        finally:
            pool.free(pages)
        return aux.cpu(), nxt.cpu()

    def __call__(self, i: int, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if i in self.cache:
            return self.cache[i]
        aux, nxt = self._forward(seq)
        size = aux.numel() * aux.element_size()
        if self.used + size <= self.budget:
            self.cache[i] = (aux, nxt)
            self.used += size
        return aux, nxt
