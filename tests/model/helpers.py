"""Test helpers: a model on the torch reference backend with a paged latent cache, stepped through
ForwardBatch.build the way the engine does it (decode requests first, then prefill chunks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlaserve.attention.base import ForwardBatch, SeqChunk
from mlaserve.attention.torch_ref import TorchRefBackend
from mlaserve.config import ModelConfig
from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from mlaserve.models.make_random import make_random
from mlaserve.models.weights import load_weights


def make_tiny(out: str, seed: int = 0, dtype: str = "float32", **overrides) -> str:
    """The tiny preset with `overrides` applied to its config, written to `out`."""
    return make_random("tiny", str(out), seed=seed, dtype=dtype, progress=False, overrides=overrides)


def load_model(path: str, dtype=torch.float32, device="cpu") -> DeepseekV3ForCausalLM:
    """config.json -> model -> weights, as the engine loads a folder (errors: ConfigError, CheckpointError)."""
    model = DeepseekV3ForCausalLM(ModelConfig.from_pretrained(str(path)), dtype=dtype)
    load_weights(model, str(path), progress=False)
    return model.to(device).eval()


@dataclass
class Seq:
    """One request's cache state: its page table and the tokens already in the cache."""

    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @property
    def num_cached(self) -> int:
        return len(self.tokens)


class RefRunner:
    """A model + TorchRefBackend + paged KV cache. `step` runs one ForwardBatch; `prefill` and `greedy`
    are the usual loops on top of it. The cache lives on the model's device. Pages are handed out in a
    shuffled order, so page tables are not the identity and a request's pages are rarely adjacent."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        num_pages: int = 128,
        page_size: int = 4,
        cache_dtype: torch.dtype | None = None,
        seed: int = 0,
        kv_scale: float = 1.0,
        backend=TorchRefBackend,
    ):
        cfg = model.config
        self.model, self.page_size = model, page_size
        dtype = cache_dtype or model.lm_head.weight.dtype
        self.kv_cache = torch.zeros(
            cfg.num_hidden_layers,
            num_pages,
            page_size,
            cfg.kv_cache_dim,
            dtype=dtype,
            device=model.lm_head.weight.device,
        )
        if dtype == torch.float8_e4m3fn:  # an FP8 cache: one scale per layer, read back in the model's dtype
            scale = torch.full((cfg.num_hidden_layers,), kv_scale, device=self.kv_cache.device)
            self.attn = backend(self.kv_cache, cfg.kv_lora_rank, scale, model.lm_head.weight.dtype)
        else:
            self.attn = backend(self.kv_cache, cfg.kv_lora_rank)
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()

    def new_seq(self) -> Seq:
        return Seq()

    def release(self, seq: Seq) -> None:
        self.free += seq.pages
        seq.pages, seq.tokens = [], []

    def fork(self, seq: Seq) -> Seq:
        """A copy of `seq` with its own pages holding the same cache contents."""
        new = Seq(tokens=list(seq.tokens))
        self._reserve(new, 0)
        self.kv_cache[:, new.pages] = self.kv_cache[:, seq.pages[: len(new.pages)]]
        return new

    def _reserve(self, seq: Seq, n_new: int) -> None:
        need = -(-(seq.num_cached + n_new) // self.page_size) - len(seq.pages)
        if need > len(self.free):
            raise RuntimeError(f"out of KV pages: need {need}, {len(self.free)} free")
        seq.pages += [self.free.pop() for _ in range(max(need, 0))]

    @torch.no_grad()
    def step(self, decode=(), prefill=(), need_logits: str = "last") -> list[torch.Tensor]:
        """Run one forward. decode, prefill: lists of (seq, new_token_ids). Returns, per request in the
        order decode + prefill, its fp32 logits: [1, vocab] ("last"), [n, vocab] ("all"), or None."""
        chunks = []
        for seq, ids in [*decode, *prefill]:
            self._reserve(seq, len(ids))
            chunks.append(SeqChunk(list(ids), seq.num_cached, list(seq.pages), need_logits))
        nd = len(decode)
        batch = ForwardBatch.build(chunks[:nd], chunks[nd:], self.page_size, self.kv_cache.device, self.attn)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        out, row = [], 0
        for (seq, ids), c in zip([*decode, *prefill], chunks):
            n = {"last": 1, "all": len(ids), "none": 0}[c.need_logits]
            out.append(logits[row : row + n] if n else None)
            row += n
            seq.tokens += list(ids)
        return out

    def prefill(self, prompts: list[list[int]], chunk: int | None = None) -> tuple[list[Seq], list[torch.Tensor]]:
        """All prompts together, `chunk` tokens of each per step (None: whole prompts in one step).
        Returns the new requests and each prompt's logits at every position [len, vocab]."""
        seqs = [self.new_seq() for _ in prompts]
        logits = [[] for _ in prompts]
        chunk = chunk or max(len(p) for p in prompts)
        for start in range(0, max(len(p) for p in prompts), chunk):
            live = [i for i, p in enumerate(prompts) if start < len(p)]
            outs = self.step(prefill=[(seqs[i], prompts[i][start : start + chunk]) for i in live], need_logits="all")
            for i, o in zip(live, outs):
                logits[i].append(o)
        return seqs, [torch.cat(x) for x in logits]

    def greedy(self, seqs: list[Seq], next_tokens: list[int], steps: int) -> tuple[list[list[int]], torch.Tensor]:
        """Decode `steps` tokens per request, one at a time, all requests in one batch. `next_tokens` are the
        tokens to feed first (not yet cached). Returns the chosen tokens and the logits [steps, B, vocab]."""
        tokens, all_logits = [[] for _ in seqs], []
        feed = list(next_tokens)
        for _ in range(steps):
            logits = torch.cat(self.step(decode=[(s, [t]) for s, t in zip(seqs, feed)]))  # [B, vocab]
            all_logits.append(logits)
            feed = logits.argmax(-1).tolist()
            for toks, t in zip(tokens, feed):
                toks.append(t)
        if not all_logits:
            return tokens, torch.empty(0, len(seqs), self.model.config.vocab_size)
        return tokens, torch.stack(all_logits)


def generate_greedy(runner: RefRunner, prompts: list[list[int]], steps: int, chunk: int | None = None):
    """Prefill the prompts together, then decode them greedily in one batch until each has `steps` new
    tokens. Returns (the new tokens per prompt, the logits that chose them [steps, B, vocab])."""
    seqs, logits = runner.prefill(prompts, chunk)
    first = torch.stack([lg[-1] for lg in logits])  # [B, vocab]
    tokens, dec_logits = runner.greedy(seqs, first.argmax(-1).tolist(), steps - 1)
    return [[f] + t for f, t in zip(first.argmax(-1).tolist(), tokens)], torch.cat([first[None], dec_logits])
