"""The Triton attention backend: fused RoPE + KV store, split-KV MLA decode, varlen prefill (GPU fast path).

Per-batch metadata the prefill path needs (cu_q, cu_k, the context's cache slots) is derived on the device once per
forward and reused by the following layers; only sizes come from the batch's host lists. A forward is recognised by
layer ids rising on the same ForwardBatch object, so a batch object refilled in place for a new step is recomputed.
Decode is mla_decode's split kernel, then its combine kernel. absorb_q_rope: the query's absorption and its RoPE
in one launch for 1-2 token steps; absorb_q_rope_store_kv: the same launch also writes the step's KV-cache rows
(decode-only steps; KernelConfig.absorb_store, MLASERVE_ABSORB_STORE=0 turns it off).
"""

from __future__ import annotations

import torch

from ..kernel_config import KernelConfig
from ..kernels.head_gemv import absorb_q_rope, absorb_q_rope_store_kv, head_gemv_serves
from ..kernels.mla_decode import mla_decode
from ..kernels.prefill_attention import prefill_attention_mla
from ..kernels.prefill_attention_gluon import prefill_attention_mla_gluon
from ..kernels.prefill_attention_gluon import supported as prefill_gluon_supported
from ..kernels.rope_kv import rope_q, rope_store_kv
from .base import AttentionBackend, ForwardBatch
from .kv_fp8 import dequantize_kv


class TritonMLABackend(AttentionBackend):
    reads_host_decode_lens = False  # decode reads batch.seq_lens on the device; the host mirrors size prefill

    def __init__(
        self,
        kv_cache: torch.Tensor,
        kv_lora_rank: int,
        num_splits: int | None = None,
        kernels: KernelConfig = KernelConfig(),
        kv_scale: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(kv_cache, kv_lora_rank, kv_scale, dtype)
        self.num_splits = num_splits  # None: mla_decode's heuristic from (B, H)
        self.kernels = kernels
        # absorb_q_rope_store_kv: the KV store inside absorb_q_rope's launch (off: MLASERVE_ABSORB_STORE=0, for A/B)
        self.absorb_store = kernels.absorb_store
        self._meta_batch: ForwardBatch | None = None
        self._meta_layer = -1
        self._meta: dict = {}
        self._dec_batch: ForwardBatch | None = None  # deterministic mode's verify rows (_verify_as_decode)
        self._dec_layer = -1
        self._dec: tuple[torch.Tensor, torch.Tensor] | None = None

    def _scale(self, layer_id: int) -> torch.Tensor | None:
        """An FP8 cache's scale of the layer [1] (a view: its address is fixed under CUDA graphs); None otherwise."""
        return self.kv_scale[layer_id : layer_id + 1] if self.fp8 else None

    def _prefill_meta(self, layer_id: int, batch: ForwardBatch) -> dict:
        """cu_q, cu_k [n+1] int32, max_q_len and the flat cache slots [C] of the prefill requests' contexts."""
        fresh = self._meta_batch is batch and layer_id > self._meta_layer
        self._meta_layer = layer_id
        if fresh:
            return self._meta
        nd, dev = batch.num_decode_reqs, batch.seq_lens.device
        qsl = batch.query_start_loc
        if batch.context_is_new:  # every prefill context is this step's tokens: no host sizes (CUDA graphs)
            cu_q = (qsl[nd:] - qsl[nd]).to(torch.int32)
            slots = batch.slot_mapping[batch.num_decode_tokens :].clamp(min=0)  # padding (-1) reads slot 0
            self._meta_batch = batch
            self._meta = dict(cu_q=cu_q, cu_k=cu_q, slots=slots, max_q_len=batch.max_query_len)
            return self._meta
        # C from the host mirrors: under a context graph (engine/cuda_graph.py) the static context bucket, which the
        # device's lengths sum to exactly; no step here reads the device back (capturable)
        lens_cpu = batch.seq_lens_cpu[nd:]
        n, C = len(lens_cpu), sum(lens_cpu)
        lens = batch.seq_lens[nd:].long()  # [n]
        cu_k = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        torch.cumsum(lens, 0, out=cu_k[1:])
        cu_q = (qsl[nd:] - qsl[nd]).to(torch.int32)
        row = torch.arange(C, device=dev)
        ends = cu_k[1:].long()
        req = torch.searchsorted(ends, row, right=True)  # [C]: each context row's request (empty ones skipped)
        pos = row - cu_k[:-1].long()[req]
        pages = batch.page_table[nd:].long()[req, pos // self.page_size]
        slots = pages * self.page_size + pos % self.page_size
        self._meta_batch = batch
        self._meta = dict(cu_q=cu_q, cu_k=cu_k, slots=slots, max_q_len=max(batch.query_lens_cpu[nd:], default=0))
        return self._meta

    def absorb_q_rope(self, q, w_kc, cos, sin, Q):
        """1-2 token steps (head_gemv_serves): kernels/head_gemv.absorb_q_rope, bit for bit head_gemv + rope_q."""
        if not head_gemv_serves(q[..., : w_kc.shape[1]], w_kc, self.kernels.head_gemv_max_tokens):
            return False
        absorb_q_rope(q, w_kc, cos, sin, Q, pdl=self.kernels.pdl)
        return True

    def absorb_q_rope_store_kv(self, layer_id, q, w_kc, c_kv, k_pe, cos, sin, batch, norm=None):
        """1-2 token steps (head_gemv_serves) whose norm weight has c_kv's dtype: kernels/head_gemv.
        absorb_q_rope_store_kv, the KV store as one more program of absorb_q_rope's launch (no side stream)."""
        if not self.absorb_store or (norm is not None and norm.weight.dtype != c_kv.dtype):  # one dtype for the norm
            return None
        if not head_gemv_serves(q[..., : w_kc.shape[1]], w_kc, self.kernels.head_gemv_max_tokens):
            return None
        Q = q.new_empty(q.shape[0], q.shape[1], w_kc.shape[-1] + k_pe.shape[-1])  # [T, H, R+P]
        return absorb_q_rope_store_kv(
            q,
            w_kc,
            cos,
            sin,
            Q,
            self.kv_cache[layer_id],
            batch.slot_mapping,
            c_kv,
            k_pe,
            None if norm is None else norm.weight,
            1e-6 if norm is None else norm.eps,
            pdl=self.kernels.pdl,
            kv_scale=self._scale(layer_id),
        )

    def rope_q(self, x, cos, sin, out):
        return rope_q(x, cos, sin, out, pdl=self.kernels.pdl)

    def store_kv(self, layer_id, c_kv, k_pe, cos, sin, batch, norm=None):
        if norm is not None and norm.weight.dtype != c_kv.dtype:  # the fused norm needs one dtype
            c_kv, norm = norm(c_kv), None
        rope_store_kv(
            self.kv_cache[layer_id],
            batch.slot_mapping,
            c_kv,
            k_pe,
            cos,
            sin,
            None if norm is None else norm.weight,
            1e-6 if norm is None else norm.eps,
            pdl=self.kernels.pdl,
            kv_scale=self._scale(layer_id),
        )

    def _verify_as_decode(self, layer_id: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Deterministic mode's verify of width N: each of its B * N rows as a decode row of its own (page table
        [B * N, max_pages], seq_lens [B * N]: row j of a request sees seq_len - N + 1 + j positions), so each is
        computed exactly as plain decode computes that position. Derived on the device once per forward."""
        if self._dec_batch is batch and layer_id > self._dec_layer:
            self._dec_layer = layer_id
            return self._dec
        nd, n = batch.num_decode_reqs, batch.decode_q_len
        lens = batch.seq_lens[:nd].repeat_interleave(n) - (n - 1)
        lens += torch.arange(n, dtype=lens.dtype, device=lens.device).repeat(nd)
        self._dec = (batch.page_table[:nd].repeat_interleave(n, dim=0), lens)
        self._dec_batch, self._dec_layer = batch, layer_id
        return self._dec

    def decode(self, layer_id, q, scale, batch, out):
        nd, q_len = batch.num_decode_reqs, batch.decode_q_len
        page_table, seq_lens = batch.page_table[:nd], batch.seq_lens[:nd]
        splits, cfg = self.kernels.mla_decode_args()  # deterministic mode: a cut by the sequence's length alone
        plan = max(nd, batch.plan_decode_reqs)  # an eager step planned as its padded graph twin (ForwardBatch)
        if self.kernels.deterministic and q_len > 1:  # a verify row is a decode row, bit for bit
            (page_table, seq_lens), plan, q_len = self._verify_as_decode(layer_id, batch), plan * q_len, 1
        return mla_decode(
            q,
            self.kv_cache[layer_id],
            page_table,
            seq_lens,
            q_len,
            scale,
            out,
            num_splits=self.num_splits or splits,
            config=cfg,
            pdl=self.kernels.pdl,
            kv_scale=self._scale(layer_id),
            plan_batch=plan,
        )

    def prefill_context(self, layer_id, batch):
        cache = self.kv_cache[layer_id].view(-1, self.kv_cache.shape[-1])  # [slots, R+P]
        rows = cache.index_select(0, self._prefill_meta(layer_id, batch)["slots"])
        return dequantize_kv(rows, self.kv_scale[layer_id], self.dtype) if self.fp8 else rows

    def prefill(self, q, k_nope, k_rope, v, scale, batch, out):
        # the model calls this right after its layer's prefill_context, which refreshed the metadata
        m = self._meta if self._meta_batch is batch else self._prefill_meta(-1, batch)
        args = (q, k_nope, k_rope, v, m["cu_q"], m["cu_k"], scale, out, m["max_q_len"])
        if self.kernels.prefill_gluon and prefill_gluon_supported(q, k_nope, k_rope, v, out):
            return prefill_attention_mla_gluon(*args)
        return prefill_attention_mla(*args)
