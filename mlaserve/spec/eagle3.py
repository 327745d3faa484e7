"""The EAGLE3 proposer: runs the draft over each step's new (target hidden, next token) pairs, then chains
`num_steps` greedy draft tokens. Its KV cache shares the target's page tables; positions it wrote past
the accepted tokens are simply overwritten by the next step's extension.

Draft position p holds the pair (target aux hidden at p, token at p+1): it predicts the token at p+2.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..attention.base import ForwardBatch, SeqChunk
from ..config import SpecConfig
from ..distributed.tp import RankInfo
from ..kernel_config import use_kernels
from ..models.eagle3 import DraftConfig, load_draft, shardable
from ..types import Request

log = logging.getLogger("mlaserve.spec")


@dataclass
class DraftChunk:
    """One request's slice of a draft extension: tokens at positions start.. with the target's aux hidden."""

    req: Request
    token_ids: list[int]  # tokens at positions start+1 .. start+n (the "next token" of each pair)
    start: int  # first position
    # [n, A*D] target aux hidden states (A = num_aux_hidden_states) at positions start .. start+n-1 (verify: all N rows)
    hidden: torch.Tensor
    propose: bool  # this request decodes next: chain num_steps draft tokens after the chunk
    verify: bool = False  # the chunk follows a verify: token_ids are the emitted 1 + a tokens


def aux_layer_ids(cfg: DraftConfig, num_layers: int, offset: int) -> tuple[int, ...]:
    """The target layers whose incoming residual stream the draft reads (num_layers = the final pre-norm stream).

    Explicit `eagle_aux_hidden_state_layer_ids` get + offset: vLLM reads id i as the stream entering layer i (offset
    0), SGLang as the output of layer i (offset 1). The default ids (2, L // 2, L - 3) are the streams entering those
    layers in both, so the offset does not apply to them."""
    n = getattr(cfg, "num_aux_hidden_states", 3)
    if cfg.aux_layer_ids:
        out = tuple(i + offset for i in cfg.aux_layer_ids)
    elif n == 3:
        out = (2, num_layers // 2, num_layers - 3)
    else:
        raise ValueError(
            f"speculative_config.draft_model: num_aux_hidden_states={n} without eagle_aux_hidden_state_layer_ids; "
            "the default layers are three: give the draft's layer ids"
        )
    bad = [i for i in out if not 0 <= i <= num_layers]
    if bad or len(out) != n:
        shown = list(cfg.aux_layer_ids or out)
        raise ValueError(
            f"speculative_config.draft_model: eagle_aux_hidden_state_layer_ids {shown} (aux_layer_offset {offset} on "
            f"explicit ids) do not fit the target's num_hidden_layers {num_layers}: need {n} layers in 0..{num_layers}"
        )
    return out


def check_draft_fits(cfg: DraftConfig, tc) -> None:
    """Refuse a draft whose shapes do not fit the target (tc: its ModelConfig), naming the field and both values."""
    for field, mine, theirs in (
        ("target_hidden_size", cfg.target_hidden_size, ("hidden_size", tc.hidden_size)),
        ("vocab_size", cfg.vocab_size, ("vocab_size", tc.vocab_size)),
    ):
        if mine != theirs[1]:
            raise ValueError(
                f"speculative_config.draft_model: the draft's {field} {mine} does not fit the target's "
                f"{theirs[0]} {theirs[1]}"
            )
    if not 1 <= cfg.draft_vocab_size <= tc.vocab_size:
        raise ValueError(
            f"speculative_config.draft_model: the draft's draft_vocab_size {cfg.draft_vocab_size} does not fit the "
            f"target's vocab_size {tc.vocab_size}"
        )


def draft_page_bytes(cfg: DraftConfig, page_size: int, dtype: torch.dtype, shards: int = 1) -> int:
    """A page of the draft's cache on one rank; shards: the ranks its GQA heads split over (an MLA latent is whole)."""
    if cfg.mla is not None:
        return page_size * cfg.mla.kv_cache_dim * dtype.itemsize
    return page_size * 2 * (cfg.num_key_value_heads // shards) * cfg.head_dim * dtype.itemsize


def full_embedding(runner) -> torch.nn.Embedding:
    """The target's whole embedding table on this rank (an EAGLE3 draft runs on rank 0 alone under TP): read from
    the checkpoint, or random for dummy weights."""
    c = runner.model_cfg
    emb = torch.nn.Embedding(c.vocab_size, c.hidden_size, device=runner.device, dtype=runner.dtype)
    emb.weight.requires_grad_(False)
    if runner.cfg.load_format == "dummy":
        emb.weight.normal_(0.0, 1.0)
        return emb
    from safetensors import safe_open

    from ..models.weights import checkpoint_files

    key = c.weight_prefix + "model.embed_tokens.weight"
    for f in checkpoint_files(runner.cfg.model):
        with safe_open(f, framework="pt", device="cpu") as h:
            if key in h.keys():
                emb.weight.copy_(h.get_tensor(key))
                return emb
    raise ValueError(f"{runner.cfg.model}: no tensor {key!r} for the draft's shared embedding")


class Eagle3Proposer:
    """The draft model's proposer; `_load` gives the draft (the MTP proposer, spec/mtp.py, overrides it).

    `followers`: on rank 0 of a draft sharded over TP (MTP), the runner, whose follow_draft sends each draft step to
    the other ranks before this one runs it (they run `extend` and `run_verified` with the same inputs); None where
    the draft runs on this rank alone (one rank; an EAGLE3 draft, whole on rank 0 under TP)."""

    def __init__(self, spec: SpecConfig, runner):
        self.k = spec.num_steps
        self.followers = None
        self.page_size = runner.cfg.page_size
        self.device = runner.device
        self.draft, ids, mla = self._load(spec, runner)
        use_kernels(self.draft, runner.kernels)
        self.pdl = runner.kernels.pdl
        runner.model.aux_layer_ids = ids
        pages, gpu = runner.num_pages, self.device.type == "cuda"
        if mla is not None:  # the draft's one MLA layer: its latent KV in a cache of its own, in the model dtype
            cache = torch.zeros(1, pages, self.page_size, mla.kv_cache_dim, dtype=runner.dtype, device=self.device)
            if gpu:  # triton is imported only where it runs
                from ..attention.triton_mla import TritonMLABackend

                self.attn = TritonMLABackend(cache, mla.kv_lora_rank, kernels=runner.kernels)
            else:
                from ..attention.torch_ref import TorchRefBackend

                self.attn = TorchRefBackend(cache, mla.kv_lora_rank)
        else:
            cfg, kv_heads = self.draft.cfg, self.draft.midlayer.self_attn.num_kv_heads  # this rank's
            from ..attention.mha_ref import PagedMHARef

            cache = torch.zeros(
                pages, self.page_size, 2, kv_heads, cfg.head_dim, dtype=runner.dtype, device=self.device
            )
            if gpu:
                from ..attention.triton_mha import TritonPagedMHA

                self.attn = TritonPagedMHA(cache)
            else:
                self.attn = PagedMHARef(cache)
        self.graphs = None  # DraftGraphs once capture_graphs() ran

    def _load(self, spec: SpecConfig, runner):
        """-> (the draft, the target's aux layer ids it reads, the MLA config of its attention or None: GQA)."""
        target, ranks = runner.model, runner.ranks
        tc = target.config
        cfg = DraftConfig.from_pretrained(spec.draft_model)
        check_draft_fits(cfg, tc)
        ids = aux_layer_ids(cfg, tc.num_hidden_layers, spec.aux_layer_offset)
        embed = target.model.embed_tokens
        sharded = ranks.world_size > 1 and shardable(cfg, ranks.world_size)
        if ranks.world_size > 1 and not sharded:  # the draft runs on rank 0 alone: it needs the whole vocabulary
            embed = full_embedding(runner)
        draft = load_draft(spec.draft_model, runner.dtype, runner.device, embed, ranks if sharded else RankInfo())
        if sharded and ranks.rank == 0:
            self.followers = runner  # the other ranks run each draft step with this one
        width = draft.embed_tokens.weight.shape[-1]
        if width != cfg.hidden_size:  # the target's embedding, shared: its width is the target's hidden size
            raise ValueError(
                f"speculative_config.draft_model: the draft's hidden_size {cfg.hidden_size} does not fit the "
                f"target's hidden_size {width} (the draft has no embed_tokens of its own and shares the target's)"
            )
        if ranks.rank == 0:
            where = f"split over {ranks.world_size} ranks" if sharded else "whole on this rank"
            if ranks.world_size > 1 and not sharded:
                where += f" (its heads or MLP do not divide by {ranks.world_size})"
            log.info("EAGLE3 draft %s, %s: %d draft steps, aux layers %s", cfg.architecture, where, spec.num_steps, ids)
        return draft, ids, cfg.mla

    def _run(self, chunks: list[SeqChunk], hidden: torch.Tensor):
        batch = ForwardBatch.build([], chunks, self.page_size, self.device, self.attn)
        normed, h = self.draft(batch.input_ids, batch.positions, hidden, batch, rows=batch.logits_indices)
        return self.draft.draft_token_ids(normed), h

    def capture_graphs(self, max_bs: int, max_pages: int, use_graphs: bool = True) -> None:
        """The static draft step after a verify, for up to max_bs requests (captured on every rank of a sharded
        draft, together)."""
        from .draft_graph import DraftGraphs

        if self.followers is not None:
            self.followers.follow_draft_capture(max_bs, max_pages, use_graphs)
        self.graphs = DraftGraphs(self, max_bs, max_pages, self.draft.hidden_width, use_graphs)
        self.graphs.capture()

    @torch.inference_mode()
    def propose_verified(
        self,
        y: torch.Tensor,
        acc: torch.Tensor,
        hidden: torch.Tensor | None,
        reqs: list[Request],
        starts: list[int] | None = None,
        shift: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Draft after a decode-only verify, from its device outputs (y [B, N] target tokens, acc [B] accepted counts,
        hidden [B * N, 3D] aux hidden states) -> drafts [B, K] on the device, with no host round trip; None: the
        static step does not fit (the caller reads y and acc back and calls propose). The verify's first positions:
        starts (default each request's num_computed_tokens) plus shift [B] on the device, if given."""
        pages = [r.pages for r in reqs]
        if self.graphs is None or hidden is None or not self.graphs.fits(pages):
            return None
        starts = [r.num_computed_tokens for r in reqs] if starts is None else starts
        return self.run_verified(y, acc, hidden, starts, pages, shift)

    def run_verified(self, y, acc, hidden, starts: list[int], pages: list[list[int]], shift=None) -> torch.Tensor:
        """The static draft step after a verify (DraftGraphs.run_verified, which gives the arguments), on every rank
        that holds a shard of the draft."""
        hidden = hidden.to(self.draft.hidden_dtype)
        if self.followers is not None:
            self.followers.follow_draft_verified(starts, pages, y, acc, shift, hidden)
        return self.graphs.run_verified(y, acc, hidden, starts, pages, shift)

    @torch.inference_mode()
    def propose(self, chunks: list[DraftChunk]) -> dict[str, list[int]]:
        """Extend the draft over every chunk; for those with `propose`, return num_steps draft tokens."""
        if not chunks:
            return {}
        if (
            self.graphs is not None
            and all(c.verify for c in chunks)
            and self.graphs.fits([c.req.pages for c in chunks])
        ):
            return self._propose_verified_chunks(chunks)
        seq = [SeqChunk(c.token_ids, c.start, c.req.pages, "last" if c.propose else "none") for c in chunks]
        drafts = self.extend(seq, torch.cat([c.hidden[: len(c.token_ids)] for c in chunks]))
        if drafts is None:
            return {}
        wanted = [c for c in chunks if c.propose]
        return {c.req.request_id: d for c, d in zip(wanted, drafts.tolist())}

    def _propose_verified_chunks(self, chunks: list[DraftChunk]) -> dict[str, list[int]]:
        """chunks: one per verified request (its emitted tokens), each with all N aux rows in `hidden`: the static
        step's inputs made on the host."""
        N, dev = self.k + 1, self.device
        y = [c.token_ids + [c.token_ids[-1]] * (N - len(c.token_ids)) for c in chunks]
        y = torch.tensor(y, dtype=torch.int64).to(dev, non_blocking=True)
        acc = torch.tensor([len(c.token_ids) - 1 for c in chunks], dtype=torch.int64).to(dev, non_blocking=True)
        hidden = torch.cat([c.hidden for c in chunks])
        drafts = self.run_verified(y, acc, hidden, [c.start for c in chunks], [c.req.pages for c in chunks])
        return {c.req.request_id: d for c, d in zip(chunks, drafts.tolist())}

    @torch.inference_mode()
    def extend(self, seq: list[SeqChunk], hidden: torch.Tensor) -> torch.Tensor | None:
        """Extend the draft over seq (hidden [tokens, width]: the target hidden of each of their tokens), then chain
        num_steps draft tokens after each chunk that asks for its last row -> [n asking, K], or None if none asks."""
        hidden = hidden.to(self.draft.hidden_dtype)
        if self.followers is not None:
            self.followers.follow_draft(seq, hidden)
        tokens, h = self._run(seq, hidden)
        wanted = [s for s in seq if s.need_logits == "last"]
        if not wanted:  # prompt chunks that only extend the draft's KV: no chain to run on zero rows
            return None
        steps = [tokens]
        for i in range(1, self.k):
            nxt = [SeqChunk([0], s.num_cached + len(s.token_ids) + i - 1, s.pages, "last") for s in wanted]
            batch = ForwardBatch.build([], nxt, self.page_size, self.device, self.attn)
            batch.input_ids.copy_(steps[-1])  # the previous draft tokens, without a host round trip
            normed, h = self.draft(batch.input_ids, batch.positions, h, batch)
            steps.append(self.draft.draft_token_ids(normed))
        return torch.stack(steps, dim=1)  # [n, K]
