"""References for the sampling tests: the model's own logits over a whole sequence (one full forward, no sampler),
and vLLM's logits processors written out per token in plain Python."""

from __future__ import annotations

import torch


def model_logits(engine, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32: the logits after each token of `ids`, from one forward on pages borrowed from the pool
    (the engine must be idle)."""
    from mlaserve.attention.base import SeqChunk

    r = engine.runner
    pages = engine.pool.allocate(engine.pool.pages_for(len(ids)))
    try:
        batch = r.build_batch([], [SeqChunk(list(ids), 0, pages, "all")])
        with torch.inference_mode():
            out = r.model(batch.input_ids, batch.positions, batch)
            hidden = out[0] if isinstance(out, tuple) else out
            return r.model.compute_logits(hidden[batch.logits_indices]).float()
    finally:
        engine.pool.free(pages)


def ref_process(logits: torch.Tensor, prompt: list[int], out: list[int], p) -> torch.Tensor:
    """One row's logits [V] after logit_bias, allowed_token_ids, min_tokens (stop ids given by p.stop_token_ids),
    repetition, frequency and presence penalties: token by token, as vLLM defines them."""
    x = logits.clone().tolist()
    for t, b in (p.logit_bias or {}).items():
        x[int(t)] += b
    if getattr(p, "allowed_token_ids", None) is not None:
        x = [v if t in p.allowed_token_ids else float("-inf") for t, v in enumerate(x)]
    if len(out) < p.min_tokens:
        for t in p.stop_token_ids:
            x[t] = float("-inf")
    for t in set(prompt) | set(out):
        r = p.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return torch.tensor(x)


def ref_greedy(engine, prompt: list[int], p, max_tokens: int) -> list[int]:
    """Greedy decoding with p's processors, each step from a full forward of prompt + output."""
    out: list[int] = []
    for _ in range(max_tokens):
        row = model_logits(engine, prompt + out)[-1]
        out.append(int(ref_process(row, prompt, out, p).argmax()))
    return out


def ref_greedy_banned(engine, prompt: list[int], seqs: list[tuple[int, ...]], max_tokens: int) -> list[int]:
    """Greedy decoding where a banned sequence's last token is -inf whenever the output ends with the tokens before
    it (bad_words), each step from a full forward of prompt + output."""
    out: list[int] = []
    for _ in range(max_tokens):
        row = model_logits(engine, prompt + out)[-1].clone()
        for seq in seqs:
            if len(seq) == 1 or (len(out) >= len(seq) - 1 and tuple(out[len(out) - len(seq) + 1 :]) == seq[:-1]):
                row[seq[-1]] = float("-inf")
        out.append(int(row.argmax()))
    return out
