"""ModelRunner: builds the model and its paged KV cache on one rank, and runs one forward per step.

It turns the scheduler's chunks into a ForwardBatch (the same on every TP rank), runs the model and
returns the logits of the positions to sample. Sampling itself happens on rank 0 (engine). Under TP rank 0 sends each
step's chunks to the other ranks as one int32 tensor over the model's group (step_broadcast.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..attention.base import ForwardBatch, SeqChunk
from ..attention.kv_fp8 import FP8_KV_DTYPE, kv_cache_torch_dtype
from ..config import EngineConfig, ModelConfig, torch_dtype
from ..distributed import tp
from ..distributed.tp import RankInfo
from ..models.deepseek_v3 import DeepseekV3ForCausalLM
from ..models.dummy_weights import init_dummy_weights
from ..models.weight_bytes import weight_bytes
from ..models.weights import load_weights
from .cpu_matmul_caches import bound_matmul_caches
from .cuda_graph import a2a_edge, decode_graph_size
from .step_broadcast import DRAFT, DRAFT_VERIFIED, DRAFT_VERIFIED_SHIFT, EAGER, STEP, SUFFIX, StepChannel
from .suffix import suffix_batch_size, suffix_on, suffix_rows

log = logging.getLogger("mlaserve.runner")

# A step of decode rows and new prompts' chunks (a request admitted while others decode) runs as the decode rows'
# graph, then the chunks' prefill graph, where the chunks hold at most this many tokens: one eager forward over
# both is bound by the host's launches, while two replays read the weights twice. Past it the chunks' compute
# hides the launches and one forward wins (benchmarks/mixed_step.py).
MIXED_SPLIT_MAX_TOKENS = 2048


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# The settings a rank computes with, which must be rank 0's (a follower node builds its own from its flags), and
# every field of its KernelConfig.
SAME_ON_EVERY_RANK = (
    "dtype",
    "page_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "prefill_graph_max_tokens",
    "prefill_graph_max_context",
    "enforce_eager",
    "attention_backend",
    "kv_cache_dtype",
    "moe_backend",
    "load_format",
    "seed",
)


def check_ranks_agree(cfg: EngineConfig, model_cfg: ModelConfig, ranks: RankInfo, extra_page_bytes: int) -> None:
    """Refuse, on every rank, a start where a rank's model, layout or settings differ from rank 0's, naming the
    rank, the field and both values: ranks that split or compute differently would run without an error and emit
    wrong tokens."""
    mine = {"moe_tp_size (--moe-tp-size)": ranks.moe_tp_size, "ep_size (--ep-size)": ranks.ep_size}
    fields = [f.name for f in dataclasses.fields(model_cfg) if f.compare]
    mine.update((f"the model's config.json: {f}", getattr(model_cfg, f)) for f in fields)
    mine.update((f, getattr(cfg, f)) for f in SAME_ON_EVERY_RANK)
    mine["the draft's KV bytes a page (--speculative-*)"] = extra_page_bytes
    mine.update((f"kernels.{f.name}", getattr(cfg.kernels, f.name)) for f in dataclasses.fields(cfg.kernels))
    every = tp.all_gather_object(mine)
    for r, theirs in enumerate(every):
        bad = [k for k in mine if theirs[k] != every[0][k]]
        if bad:
            k = bad[0]
            raise ValueError(
                f"rank {r} was started with {k} = {theirs[k]!r} and rank 0 with {every[0][k]!r}"
                + (f" (and {len(bad) - 1} more: {', '.join(bad[1:])})" if len(bad) > 1 else "")
                + ": start every node with the same flags and MLASERVE_* environment"
            )


def resolve_dtype(dtype: str, model_cfg: ModelConfig) -> torch.dtype:
    return torch_dtype(model_cfg.torch_dtype if dtype == "auto" else dtype)


class ModelRunner:
    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig,
        ranks: RankInfo = RankInfo(),
        extra_page_bytes: int = 0,
        reserve_bytes: int = 0,
    ):
        self.cfg, self.model_cfg, self.ranks = cfg, model_cfg, ranks
        self.extra_page_bytes = extra_page_bytes  # e.g. the EAGLE3 draft's KV cache shares the page ids
        self.reserve_bytes = reserve_bytes  # weights loaded after the cache is sized (the MTP draft's), kept free
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(cfg.dtype, model_cfg)
        self.kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, self.dtype)
        check_ranks_agree(cfg, model_cfg, ranks, extra_page_bytes)
        self.kernels = cfg.kernels  # what every kernel call site of this rank gets (the same on every rank)
        tp.set_ordered_all_reduce(self.kernels.deterministic)  # the all-reduce's order per element, not by size
        on_gpu = self.device.type == "cuda"
        if self.device.type == "cpu":  # before the first bf16 matmul, which fixes their capacity
            bound_matmul_caches()
        moe_impl = cfg.moe_backend if cfg.moe_backend != "auto" else ("triton" if on_gpu else "torch")
        self.moe_impl = moe_impl  # the MTP draft's layer takes the same

        t0 = time.perf_counter()
        with torch.device(self.device):
            self.model = DeepseekV3ForCausalLM(
                model_cfg, dtype=self.dtype, ranks=ranks, moe_impl=moe_impl, kernels=self.kernels
            )
        if cfg.load_format == "dummy":
            init_dummy_weights(self.model, seed=cfg.seed)
        else:
            load_weights(self.model, cfg.model, progress=ranks.rank == 0)
        self.model.eval()
        self.load_seconds = time.perf_counter() - t0
        self.weight_bytes = weight_bytes(self.model, ranks.rank)  # this rank's; every rank's: weight_bytes_per_rank
        log.info("%s", self.weight_bytes.line())
        self.weight_bytes_per_rank = tp.all_gather_object(self.weight_bytes)

        # Every rank indexes the same page ids: take the pages that fit on all of them.
        self.num_pages = tp.min_over_ranks(cfg.num_pages or self._pages_from_memory())
        L, D = model_cfg.num_hidden_layers, model_cfg.kv_cache_dim
        self.kv_cache = torch.zeros(L, self.num_pages, cfg.page_size, D, dtype=self.kv_dtype, device=self.device)
        # an FP8 cache's scale per layer: 1.0 (vLLM's default for a checkpoint without KV scales)
        fp8 = self.kv_dtype == FP8_KV_DTYPE
        self.kv_scale = torch.ones(L, dtype=torch.float32, device=self.device) if fp8 else None
        if fp8 and ranks.rank == 0:
            log.info(
                "KV cache in float8_e4m3fn: one scale per layer, 1.0 (the checkpoint carries no KV scales); latent "
                "values beyond +-448 saturate"
            )
        self.attn = self._make_backend()
        self.graphs = None  # a GraphRunner once capture_graphs() ran
        self.steps = StepChannel(self.device, tp.group()) if ranks.world_size > 1 else None
        self._awake = False  # rank 0: the other ranks are receiving steps (not parked on the host group)
        self.graph_steps = 0  # forwards run by the GraphRunner (a TP rank's report of which path it took)
        log.info(
            "model loaded in %.1fs on %s (%s); KV cache: %d pages x %d tokens (%.2f GB, %s), backend %s",
            self.load_seconds,
            self.device,
            self.dtype,
            self.num_pages,
            cfg.page_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 1e9,
            str(self.kv_dtype).removeprefix("torch."),
            type(self.attn).__name__,
        )

    def _page_bytes(self) -> int:
        c = self.model_cfg
        kv = c.num_hidden_layers * self.cfg.page_size * c.kv_cache_dim * self.kv_dtype.itemsize  # fp8: half of bf16's
        return kv + self.extra_page_bytes

    def _pages_from_memory(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what the caching allocator holds but does not use is free for the cache
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave (1 - utilization) of the card plus room for activations of a full token budget.
            # Activations of a full token budget (MoE and attention intermediates) plus CUDA-graph pools.
            activations = 4 * (1 << 30) + self.cfg.max_num_batched_tokens * self.model_cfg.hidden_size * 128
            budget = free - (1 - self.cfg.gpu_memory_utilization) * total - activations - self.reserve_bytes
        else:
            budget = self.cfg.kv_cache_memory_gb * (1 << 30)
        pages = int(budget // self._page_bytes())
        if pages < 2:
            raise ValueError(
                f"num_pages: no memory is left for the KV cache (budget {budget / 1e9:.2f} GB); "
                "lower max_num_batched_tokens or raise gpu_memory_utilization"
            )
        return pages

    def _make_backend(self):
        kind = self.cfg.attention_backend
        if kind == "auto":
            kind = "triton" if self.device.type == "cuda" else "torch"
        if kind == "triton":
            from ..attention.triton_mla import TritonMLABackend

            return TritonMLABackend(
                self.kv_cache,
                self.model_cfg.kv_lora_rank,
                kernels=self.kernels,
                kv_scale=self.kv_scale,
                dtype=self.dtype,
            )
        from ..attention.torch_ref import TorchRefBackend

        return TorchRefBackend(self.kv_cache, self.model_cfg.kv_lora_rank, self.kv_scale, self.dtype)

    def capture_graphs(self, decode_q_len: int, max_model_len: int, use_graphs: bool = True) -> None:
        """Decode graphs per padded batch size and prefill graphs per token bucket (after the model is final:
        an EAGLE3 proposer sets the aux layers first)."""
        from .cuda_graph import GraphRunner

        if self.ranks.world_size > 1 and self.ranks.rank == 0:
            self.park()
            tp.broadcast_object(("capture", decode_q_len, max_model_len, use_graphs))
        self.graphs = GraphRunner(
            self,
            decode_q_len,
            self.cfg.max_num_seqs,
            self.cfg.prefill_graph_max_tokens,
            self.graph_max_pages(decode_q_len, max_model_len),
            use_graphs=use_graphs,
            prefill_max_context=self.cfg.prefill_graph_max_context,
        )
        self.graphs.capture()

    def graph_max_pages(self, decode_q_len: int, max_model_len: int) -> int:
        """Page-table columns of the static steps: a request at max_model_len plus a verify's and its drafts'
        overshoot."""
        return -(-(max_model_len + 2 * decode_q_len) // self.cfg.page_size)

    def build_batch(self, decode: list[SeqChunk], prefill: list[SeqChunk]) -> ForwardBatch:
        return ForwardBatch.build(decode, prefill, self.cfg.page_size, self.device, self.attn)

    @torch.inference_mode()
    def execute(
        self,
        decode: list[SeqChunk],
        prefill: list[SeqChunk],
        decode_tokens: torch.Tensor | None = None,
        decode_shift: torch.Tensor | None = None,
        eager: bool = False,
        suffix: bool = False,
    ):
        """Run one forward -> (fp32 logits [n, vocab] of the rows the chunks asked for, in order;
        the EAGLE3 aux hidden states [T, 3D] of every token, or None; the decode graph's own arg-max of those rows,
        a GreedyTokens (engine/cuda_graph.py), or None). Device-side inputs (single rank) of a step launched before
        the step in flight is read back: decode_tokens [decode tokens] the decode chunks' input ids, in place of
        their token_ids (which then give only their lengths); decode_shift [len(decode)] int64, how many positions
        each decode chunk starts past its num_cached (ForwardBatch.shift_decode; its pages must cover that).
        eager: one eager forward whatever graph fits the step, on every rank (the warm-up's eager twins).
        suffix: a step of short suffix chunks may run them as decode rows in the absorbed form (engine/suffix.py;
        plain decoding's steps; not with eager)."""
        suffix = suffix and not eager
        if self.ranks.world_size > 1:
            if decode_tokens is not None or decode_shift is not None:
                raise ValueError("decode_tokens, decode_shift: device-side inputs need a single rank")
            self._wake()
            kind = EAGER if eager else SUFFIX if suffix else STEP
            self.steps.send(decode, prefill, kind)  # the other ranks run the same forward
        return self.execute_local(decode, prefill, decode_tokens, decode_shift, eager, suffix)

    def _wake(self) -> None:
        if not self._awake:
            tp.broadcast_object(("wake",))
            self._awake = True

    # Rank 0 of a draft sharded over TP (spec/mtp.py): each draft step goes to the other ranks first, as a step does.
    def follow_draft(self, seq: list[SeqChunk], hidden: torch.Tensor) -> None:
        """An extension (Eagle3Proposer.extend): its chunks, then hidden [tokens, width]."""
        self._wake()
        self.steps.send_draft(DRAFT, seq, [hidden])

    def follow_draft_verified(self, starts, pages, y, acc, shift, hidden) -> None:
        """A static step after a verify (DraftGraphs.run_verified's arguments): rows' starts and pages, then the
        device tensors [y | acc | shift] (int64) and hidden, sent from the device without a host round trip."""
        self._wake()
        rows = [SeqChunk([], s, p, "none") for s, p in zip(starts, pages)]
        ints = [y.reshape(-1), acc] + ([shift] if shift is not None else [])
        kind = DRAFT_VERIFIED if shift is None else DRAFT_VERIFIED_SHIFT
        self.steps.send_draft(kind, rows, [torch.cat([t.to(torch.int64) for t in ints]), hidden])

    def follow_draft_capture(self, max_bs: int, max_pages: int, use_graphs: bool) -> None:
        self.park()
        tp.broadcast_object(("capture_draft", max_bs, max_pages, use_graphs))

    def park(self) -> None:
        """Rank 0, when the engine goes idle: the other ranks stop waiting for steps inside the model group (whose
        timeout an idle server would outlast) and wait on the host group for the next burst (step_broadcast.py)."""
        if self._awake:
            self.steps.park()
            self._awake = False

    @torch.inference_mode()
    def execute_local(
        self,
        decode: list[SeqChunk],
        prefill: list[SeqChunk],
        decode_tokens: torch.Tensor | None = None,
        decode_shift: torch.Tensor | None = None,
        eager: bool = False,
        suffix: bool = False,
    ):
        n_dec = sum(len(c.token_ids) for c in decode)
        if decode_tokens is not None and decode_tokens.shape != (n_dec,):
            raise ValueError(f"decode_tokens: need one id per decode token ({n_dec}), got {tuple(decode_tokens.shape)}")
        if decode_shift is not None and decode_shift.shape != (len(decode),):
            raise ValueError(
                f"decode_shift: need one per decode chunk ({len(decode)}), got {tuple(decode_shift.shape)}"
            )
        key = self.graphs.key_for(decode, prefill, suffix) if self.graphs is not None and not eager else None
        if key is not None:
            self.graph_steps += 1
            return self.graphs.run(key, decode, prefill, decode_tokens, decode_shift)
        split = None if eager else self.split_keys(decode, prefill, suffix)
        if split is not None:  # decode rows first, then the chunks, as one forward would order its outputs
            self.graph_steps += 2
            logits, aux, _ = self.graphs.run(split[0], decode, [], decode_tokens, decode_shift)
            # copied out first: the graphs share one memory pool, so the prefill graph's replay may overwrite them
            logits, aux = logits.clone(), None if aux is None else aux.clone()
            p_logits, p_aux, _ = self.graphs.run(split[1], [], prefill)
            return torch.cat([logits, p_logits]), None if aux is None else torch.cat([aux, p_aux]), None
        rows = None
        if suffix and not decode and suffix_on(self.kernels):
            rows = suffix_rows(prefill)
        if rows is not None:  # the suffix graph's rows, planned as that graph (engine/suffix.py)
            batch = self.build_batch(rows, [])
            batch.plan_decode_reqs = suffix_batch_size(len(rows))
        else:
            batch = self.build_batch(decode, prefill)
        if decode and not prefill:  # planned as the decode graph it would pad to (ForwardBatch.plan_decode_reqs)
            q = batch.decode_q_len
            b = decode_graph_size(len(decode), q, self.cfg.max_num_seqs, a2a_edge(self.ranks, self.kernels))
            batch.plan_decode_reqs = b or len(decode)
        if decode_tokens is not None:  # decode chunks come first
            batch.input_ids[:n_dec].copy_(decode_tokens)
        if decode_shift is not None:
            batch.shift_decode(decode_shift, self.cfg.page_size, self.kernels.pdl)
        out = self.model(batch.input_ids, batch.positions, batch)
        hidden, aux = out if isinstance(out, tuple) else (out, None)
        return self.model.compute_logits(hidden[batch.logits_indices]), aux, None

    def split_keys(self, decode: list[SeqChunk], prefill: list[SeqChunk], suffix: bool = False) -> tuple | None:
        """(decode graph key, prefill graph key) for a step of decode rows and prompt chunks run as two replays
        (MIXED_SPLIT_MAX_TOKENS), or None: one forward. suffix (execute's): the chunks may take a suffix graph. Not
        in the deterministic mode, whose rows keep one path."""
        if self.graphs is None or not decode or not prefill or self.kernels.deterministic:
            return None
        if sum(len(c.token_ids) for c in prefill) > MIXED_SPLIT_MAX_TOKENS:
            return None
        kd, kp = self.graphs.key_for(decode, []), self.graphs.key_for([], prefill, suffix)
        return None if kd is None or kp is None else (kd, kp)

    def shutdown(self) -> None:
        """Rank 0: tell the other ranks to stop, then destroy the graphs (release_graphs says why)."""
        if self.ranks.world_size > 1 and self.ranks.rank == 0:
            self.park()
            tp.broadcast_object(None)
            self.release_graphs()

    def release_graphs(self) -> None:
        """Destroy the captured graphs before the process group goes: graphs with NCCL all-reduces in them keep
        ncclCommDestroy (and an abort) waiting forever (pytorch/pytorch#115388)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
