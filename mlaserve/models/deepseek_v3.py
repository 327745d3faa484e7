"""DeepSeek-V3 (and Kimi-K2 / K2.5, Moonlight): MLA attention + MoE, HF parameter names, read top to bottom.

Shapes: T tokens, D hidden, H heads on this rank, R kv_lora_rank, P qk_rope_head_dim, N qk_nope_head_dim,
V v_head_dim. Decode tokens use the absorbed MLA form, prefill tokens the naive form (docs/design.md §1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import ForwardBatch
from ..config import ModelConfig
from ..distributed import tp
from ..distributed.tp import RankInfo
from ..kernel_config import KernelConfig, use_kernels
from ..layers.activation import silu_mul
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.fp8_linear import Fp8ExpandedLinear, Fp8Linear
from ..layers.linear import invariant_linear, linear_many, stack_rows
from ..layers.moe import Experts, TopkRouter
from ..layers.moe_a2a import dispatch_combine, restore_replicated, token_slice, use_a2a
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .quant_layers import check_unquantized, linear_factory, make_experts


class DeepseekV3MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); tensor-parallel over the intermediate dim. The dense MLP all-reduces
    itself; as shared experts it leaves the reduction to the MoE block (one all-reduce for both)."""

    kernels = KernelConfig()  # the model's (DeepseekV3ForCausalLM)

    def __init__(self, hidden: int, inter: int, ranks: RankInfo, dtype, reduce: bool = True, linear=None):
        super().__init__()
        kw = dict(rank=ranks.rank, size=ranks.world_size, dtype=dtype)
        linear = linear or linear_factory(None, "")  # a model's factory names and may quantize; default: Linear
        self.gate_proj = linear("gate_proj", hidden, inter, shard="col", **kw)
        self.up_proj = linear("up_proj", hidden, inter, shard="col", **kw)
        self.down_proj = linear("down_proj", inter, hidden, shard="row", **kw)
        stack_rows(self.gate_proj, self.up_proj)  # gate and up by one GEMM
        self.reduce = reduce and ranks.world_size > 1  # a replicated copy (the EAGLE3 draft) never reduces

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, residual: torch.Tensor | None = None):
        """-> y [T, D]; with `norm` (the norm after the block) norm(y, residual): (norm(y + residual), y + residual)."""
        gate, up = linear_many(x, self.gate_proj, self.up_proj)
        if isinstance(self.down_proj, Fp8Linear):  # may quantize the product where it is computed
            y = self.down_proj.forward_silu_mul(gate, up)
        else:
            y = self.down_proj(silu_mul(gate, up, self.kernels.pdl))
        y = tp.all_reduce(y) if self.reduce else y
        return y if norm is None else norm(y, residual)


class DeepseekV3MoE(nn.Module):
    # Steps of up to kernels.fuse_shared_max_tokens tokens run the shared experts inside the fused MoE GEMMs
    # (shared-experts fusion: in decode it replaces the shared MLP's cuBLAS GEMMs, SiLU and split-K reduce); larger
    # steps keep them as dense cuBLAS GEMMs. H200, Moonlight MoE block over 8 layers' weights (kernels_bench --only
    # moe_shared): fused vs unfused T=1 55.3 vs 62.8 us, T=4 113 vs 123, T=16 194 vs 201, but T=64 284 vs 275 and
    # T=256 383 vs 379.
    kernels = KernelConfig()  # the model's (DeepseekV3ForCausalLM)

    def __init__(self, cfg: ModelConfig, ranks: RankInfo, dtype, impl: str, layer_id: int | None = None):
        super().__init__()
        self.impl = impl  # "torch" (reference) | "triton" (fused kernels)
        self.ranks = ranks
        layer_id = cfg.first_k_dense_replace if layer_id is None else layer_id  # names the layers (quantization)
        self.gate = TopkRouter(cfg)
        self.experts = make_experts(cfg, layer_id, ranks, dtype)  # Experts, or quantized (layers/quant_experts.py)
        quantized = not isinstance(self.experts, Experts)
        self.reduce = ranks.world_size > 1
        self.shared_experts = (
            DeepseekV3MLP(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                ranks,
                dtype,
                reduce=False,
                linear=linear_factory(cfg, f"model.layers.{layer_id}.mlp.shared_experts.", impl),
            )
            if cfg.n_shared_experts
            else None
        )
        # Shared-experts fusion (Triton path only; the torch path is the spec): the shared MLP's rank-local
        # intermediate is S = n_shared_experts slots of the routed experts' I_local channels, run as experts
        # E_local .. E_local+S-1 with weight 1.0 (a partition of the intermediate dim: the slots sum to the MLP).
        # The kernels read the slots in place from the shared MLP's weights, so storage, loaders and checkpoints are
        # unchanged and no copy exists. (Storing the slots as experts [E_local + S] instead would leave the dense
        # path above the threshold no single down GEMM for S > 1: S GEMMs and partial sums, a slower prefill.)
        # Valid when the shards line up: shared experts split over the world, routed ones over moe-TP, which is
        # the world only without EP. The per-rank sum stays a partial for the one all-reduce below.
        # It is bf16-only: quantized experts take the shared experts' output as `add`.
        self.fuse_shared = 0
        if impl == "triton" and self.shared_experts is not None and ranks.ep_size == 1 and not quantized:
            i_local = cfg.moe_intermediate_size // ranks.moe_tp_size
            if self.shared_experts.gate_proj.out_features == cfg.n_shared_experts * i_local:
                self.fuse_shared = cfg.n_shared_experts
        # The add + norm after the block fused into the fused MoE's sum over top-k (Triton path, one rank: with TP
        # the all-reduce comes between the sum and the add), where that norm runs its own kernel (the fused one
        # rounds as that kernel does, so the two paths agree bit for bit).
        self.fuse_norm = impl == "triton" and not self.reduce

    def forward(
        self,
        x: torch.Tensor,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
        plan_tokens: int = 0,
    ):
        """-> y [T, D]; with `norm` (the norm after the block) norm(y, residual): (norm(y + residual), y + residual).
        plan_tokens: the experts choose their kernels for max(T, plan_tokens) tokens (ForwardBatch.plan_tokens)."""
        if use_a2a(x.shape[0], self.ranks, self.kernels.moe_a2a_min_tokens):
            y = self.forward_a2a(x)
            return y if norm is None else norm(y, residual)
        S = self.fuse_shared if self.impl == "triton" and x.shape[0] <= self.kernels.fuse_shared_max_tokens else 0
        weights, ids = self.route(x, S)
        if S:  # ids [T, K+S]: the shared MLP runs inside the fused MoE as S more experts of weight 1.0
            sh = self.shared_experts
            kw = dict(impl="triton", shared=(sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight))
        else:  # routed + shared, summed in one pass
            kw = dict(impl=self.impl, add=self.shared_experts(x) if self.shared_experts is not None else None)
        kw["plan_tokens"] = plan_tokens
        if norm is not None and self.fuse_norm and norm.uses_kernel(x, residual):  # sum over k, add, norm: 1 kernel
            return self.experts(x, weights, ids, norm=(norm.weight, norm.eps, residual), **kw)
        y = self.experts(x, weights, ids, **kw)
        y = tp.all_reduce(y) if self.reduce else y
        return y if norm is None else norm(y, residual)

    def route(self, x: torch.Tensor, S: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, K+S] fp32, ids [T, K+S]); S shared slots appended (shared-experts fusion, Triton)."""
        if self.impl == "triton":
            from ..kernels.routing import route_noaux_tc_fused

            kc = self.kernels
            id0 = self.experts.expert_offset + self.experts.num_local
            return route_noaux_tc_fused(self.gate, x, S, id0, kc.router_splitk_max_tokens, kc.pdl, kc.deterministic)
        return self.gate(x)

    def forward_a2a(self, x: torch.Tensor) -> torch.Tensor:
        """The EP all-to-all form (layers/moe_a2a.py): this rank routes its slice of the replicated tokens, the
        experts' owners compute them, the slices are put back together -> y [T, D] on every rank. Eager only."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the MoE all-to-all (steps of >= moe_a2a_min_tokens={self.kernels.moe_a2a_min_tokens} tokens under "
                "EP) reads its split sizes on the host and cannot be captured in a CUDA graph"
            )
        T, r = x.shape[0], self.ranks
        lo, hi, _ = token_slice(T, r.rank, r.world_size)
        # [Ts, K] fp32, [Ts, K]; a rank with no tokens (T < world) routes its empty slice by the reference
        weights, ids = self.route(x[lo:hi]) if hi > lo else self.gate(x[lo:hi])
        y = dispatch_combine(self.experts, x[lo:hi], weights, ids, self.impl)  # [Ts, D]
        return restore_replicated(y, T, self.shared_experts(x) if self.shared_experts is not None else None)


def _head_gemv(x: torch.Tensor, m: torch.Tensor, out: torch.Tensor, kernels: KernelConfig) -> bool:
    """out = x @ m per head by one Triton kernel when the step is 1-2 decode tokens on the GPU (cuBLAS's bmm
    streams these 2 MB weights at 0.7-0.8 TB/s there: kernels/head_gemv.py); False: the caller runs torch.bmm."""
    from ..kernels.head_gemv import head_gemv, head_gemv_serves  # triton: imported on CUDA only

    if not head_gemv_serves(x, m, kernels.head_gemv_max_tokens):
        return False
    head_gemv(x, m, out, pdl=kernels.pdl)
    return True


def _invariant_bmm(x: torch.Tensor, m: torch.Tensor, out: torch.Tensor, kernels: KernelConfig) -> bool:
    """Deterministic mode on the GPU: out [T, H, N] = x [T, H, K] @ m [H, K, N] per head by kernels/bi_gemm, each
    token's row the same at every step size; False: the caller runs torch.bmm."""
    if not (kernels.deterministic and x.is_cuda and x.dtype == m.dtype):
        return False
    from ..kernels.bi_gemm import bi_gemm

    bi_gemm(x.transpose(0, 1), m.transpose(1, 2), out=out.transpose(0, 1), pdl=kernels.pdl)
    return True


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention. The KV cache holds [c_kv | rope(k_pe)] (R+P values) per token."""

    kernels = KernelConfig()  # the model's (DeepseekV3ForCausalLM)

    def __init__(
        self, cfg: ModelConfig, layer_id: int, ranks: RankInfo, dtype, in_features: int | None = None, impl="torch"
    ):
        super().__init__()
        D = in_features or cfg.hidden_size  # an EAGLE3 MLA draft feeds [embed | hidden], 2H wide
        if cfg.num_attention_heads % ranks.world_size:
            raise ValueError(
                f"num_attention_heads={cfg.num_attention_heads} is not divisible by attn_tp_size={ranks.world_size}"
            )
        self.layer_id = layer_id
        self.H = cfg.num_attention_heads // ranks.world_size
        self.N, self.P, self.R, self.V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        self.scale = cfg.softmax_scale
        self.reduce = ranks.world_size > 1
        heads = cfg.num_attention_heads
        col = dict(shard="col", rank=ranks.rank, size=ranks.world_size, dtype=dtype)
        lin = linear_factory(cfg, f"model.layers.{layer_id}.self_attn.", impl)  # Linear, or FP8 where quantized
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank:
            self.q_a_proj = lin("q_a_proj", D, cfg.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype)
            self.q_b_proj = lin("q_b_proj", cfg.q_lora_rank, heads * cfg.qk_head_dim, **col)
        else:
            self.q_proj = lin("q_proj", D, heads * cfg.qk_head_dim, **col)
        self.kv_a_proj_with_mqa = lin("kv_a_proj_with_mqa", D, self.R + self.P, dtype=dtype)
        stack_rows(self.q_a_proj if cfg.q_lora_rank else self.q_proj, self.kv_a_proj_with_mqa)  # both read x
        self.kv_a_layernorm = RMSNorm(self.R, cfg.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = lin("kv_b_proj", self.R, heads * (self.N + self.V), **col)  # model dtype, always
        self.o_proj = lin(
            "o_proj", heads * self.V, cfg.hidden_size, shard="row", rank=ranks.rank, size=ranks.world_size, dtype=dtype
        )

    # Per-head views of kv_b_proj.weight [H*(N+V), R]; no copies.
    @property
    def w_kc(self) -> torch.Tensor:  # [H, N, R]
        return self.kv_b_proj.weight.view(self.H, self.N + self.V, self.R)[:, : self.N]

    @property
    def w_vc(self) -> torch.Tensor:  # [H, R, V], a transposed view
        return self.kv_b_proj.weight.view(self.H, self.N + self.V, self.R)[:, self.N :].transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, H, N, V = x.shape[0], self.H, self.N, self.V
        # One GEMM for the two projections of x (column views of one output; q is then a strided view)
        if self.q_lora_rank:
            q_a, kv_a = linear_many(x, self.q_a_proj, self.kv_a_proj_with_mqa)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q, kv_a = linear_many(x, self.q_proj, self.kv_a_proj_with_mqa)
        q = q.view(T, H, N + self.P)  # [T, H, N+P]
        out = x.new_empty(T, H * V)  # caller-owned output of both forms
        Td = batch.num_decode_tokens
        if Td == T and self.forward_decode_fused(q, kv_a, cos, sin, batch, out):
            pass  # the KV store, absorb_q and the query's RoPE ran as one launch (eager and captured alike)
        elif batch.side_stream is not None and Td == T and q.is_cuda and torch.cuda.is_current_stream_capturing():
            self.forward_decode_forked(q, kv_a, cos, sin, batch, out)
        else:
            self.store_kv(kv_a, cos, sin, batch)
            if Td:
                self.forward_absorbed(q[:Td], cos[:Td], sin[:Td], batch, out[:Td])
            if Td < T:
                self.forward_naive(q[Td:], cos[Td:], sin[Td:], batch, out[Td:])
        out = self.o_proj(out)
        return tp.all_reduce(out) if self.reduce else out

    def store_kv(self, kv_a, cos, sin, batch) -> None:
        """kv_a [T, R+P]: the cache gets [kv_a_layernorm(c_kv) | rope(k_pe)], normalised inside the store."""
        R = self.R
        batch.attn.store_kv(self.layer_id, kv_a[:, :R], kv_a[:, R:], cos, sin, batch, norm=self.kv_a_layernorm)

    def forward_decode_fused(self, q, kv_a, cos, sin, batch, out) -> bool:
        """forward's decode-only form where the backend runs the KV store inside absorbed_q's launch (Triton, 1-2
        tokens: no side-stream fork, whose join before attention would keep the MLA kernel from launching early
        (PDL)); False: nothing was done."""
        R = self.R
        Q = batch.attn.absorb_q_rope_store_kv(
            self.layer_id, q, self.w_kc, kv_a[:, :R], kv_a[:, R:], cos, sin, batch, norm=self.kv_a_layernorm
        )
        if Q is None:
            return False
        self.attend_absorbed(Q, batch, out)
        return True

    def forward_decode_forked(self, q, kv_a, cos, sin, batch, out) -> None:
        """forward's decode-only form as captured in a CUDA graph: the KV store runs on the side stream beside
        absorbed_q (at batch 1-2 with the Triton backend one launch, absorb_q_rope; else absorb_q's GEMM and the
        query's RoPE), which would run in a row with it otherwise (the store is the longest). They write disjoint
        outputs (cache slots; Q), the side stream allocates nothing, and the branches join before attention reads
        them. The same kernels on the same inputs as the unforked path."""
        main, side = torch.cuda.current_stream(), batch.side_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.store_kv(kv_a, cos, sin, batch)
        Q = self.absorbed_q(q, cos, sin, batch)
        main.wait_stream(side)
        self.attend_absorbed(Q, batch, out)

    def absorb_q(self, q_nope: torch.Tensor, Q: torch.Tensor) -> None:
        """Q[..., :R] = q_nope @ w_kc per head, written in place. q_nope [T, H, N], Q [T, H, R+P]."""
        if q_nope.is_cuda and _head_gemv(q_nope, self.w_kc, Q[..., : self.R], self.kernels):
            return
        if _invariant_bmm(q_nope, self.w_kc, Q[..., : self.R], self.kernels):
            return
        torch.bmm(q_nope.transpose(0, 1), self.w_kc, out=Q[..., : self.R].transpose(0, 1))

    def absorb_out(self, o_lat: torch.Tensor, out: torch.Tensor) -> None:
        """out = o_lat @ w_vc per head, written in place. o_lat [T, H, R], out [T, H*V]."""
        T = o_lat.shape[0]
        if o_lat.is_cuda and _head_gemv(o_lat, self.w_vc, out.view(T, self.H, self.V), self.kernels):
            return
        if _invariant_bmm(o_lat, self.w_vc, out.view(T, self.H, self.V), self.kernels):
            return
        torch.bmm(o_lat.transpose(0, 1), self.w_vc, out=out.view(T, self.H, self.V).transpose(0, 1))

    def forward_absorbed(self, q, cos, sin, batch, out) -> None:
        self.attend_absorbed(self.absorbed_q(q, cos, sin, batch), batch, out)

    def absorbed_q(self, q, cos, sin, batch) -> torch.Tensor:
        """q [T, H, N+P] -> Q [T, H, R+P]: absorbed q_nope | rope(q_pe), both written into Q in place."""
        Q = q.new_empty(q.shape[0], self.H, self.R + self.P)
        if batch.attn.absorb_q_rope(q, self.w_kc, cos, sin, Q):
            return Q  # the backend ran both halves in one launch (Triton: 1-2 token steps)
        self.absorb_q(q[..., : self.N], Q)
        batch.attn.rope_q(q[..., self.N :], cos, sin, out=Q[..., self.R :])
        return Q

    def attend_absorbed(self, Q, batch, out) -> None:
        """Q [Td, H, R+P] -> out [Td, H*V]: latent attention, then the value absorption."""
        o_lat = batch.attn.decode(self.layer_id, Q, self.scale, batch, out=Q.new_empty(Q.shape[0], self.H, self.R))
        self.absorb_out(o_lat, out)

    def forward_naive(self, q, cos, sin, batch, out) -> None:
        T, H, N, R, V = q.shape[0], self.H, self.N, self.R, self.V
        batch.attn.rope_q(q[..., N:], cos, sin, out=q[..., N:])  # q is ours: rotate in place
        # [C, R+P], this step's tokens included; in the cache's dtype, which may differ from ours
        latent = batch.attn.prefill_context(self.layer_id, batch).to(q.dtype)
        C = latent.shape[0]
        kv = invariant_linear(latent[:, :R], self.kv_b_proj.weight, self.kernels)  # deterministic mode, else None
        if kv is None and isinstance(self.kv_b_proj, Fp8ExpandedLinear):
            kv = self.kv_b_proj.forward_a8(latent[:, :R])  # the checkpoint's W8A8 (kernels.fp8_kv_b_a8), else None
        kv = (F.linear(latent[:, :R], self.kv_b_proj.weight) if kv is None else kv).view(C, H, N + V)
        # k = [k_nope | k_pe] per head is never built: the backend reads kv[..., :N] and the shared latent[:, R:]
        batch.attn.prefill(q, kv[..., :N], latent[:, R:], kv[..., N:], self.scale, batch, out=out.view(T, H, V))


class DeepseekV3DecoderLayer(nn.Module):
    """Attention and MLP (or MoE), each added to the residual stream. The layer's input_layernorm is applied by
    whoever produces its input (the model before layer 0, else the previous layer), and each layer ends with the
    norm after it: every residual add is fused into the norm that follows it, and on one rank the Triton MoE's
    sum over top-k into that add + norm too."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ranks: RankInfo, dtype, moe_impl: str):
        super().__init__()
        self.self_attn = DeepseekV3Attention(cfg, layer_id, ranks, dtype, impl=moe_impl)
        self.mlp = (
            DeepseekV3MoE(cfg, ranks, dtype, moe_impl, layer_id=layer_id)
            if cfg.is_moe_layer(layer_id)
            else DeepseekV3MLP(
                cfg.hidden_size,
                cfg.intermediate_size,
                ranks,
                dtype,
                linear=linear_factory(cfg, f"model.layers.{layer_id}.mlp.", moe_impl),
            )
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, x, residual, cos, sin, batch, next_norm: RMSNorm):
        """x = input_layernorm(residual), residual: the stream entering this layer; next_norm: the norm after it
        (the next layer's input_layernorm, or the model's final norm). -> (next_norm(stream), stream), the stream
        leaving this layer."""
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, batch), residual)
        if isinstance(self.mlp, DeepseekV3MoE):  # an eager step's experts planned as its graph twin's
            return self.mlp(x, next_norm, residual, batch.plan_tokens)
        return self.mlp(x, next_norm, residual)


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, ranks: RankInfo, dtype, moe_impl: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, rank=ranks.rank, size=ranks.world_size, dtype=dtype
        )
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(cfg, i, ranks, dtype, moe_impl) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)


class DeepseekV3ForCausalLM(nn.Module):
    """forward(ids, positions, batch) -> final hidden [T, D]; compute_logits(hidden) -> fp32 [n, vocab].

    `aux_layer_ids`, when set (EAGLE3), makes forward also return the residual stream entering those
    layers (id == num_layers: the final pre-norm stream; -1: the final normed hidden, the MTP draft's),
    concatenated in id order: [T, len(ids) * D].
    `kernels` (the engine's KernelConfig) goes to every module that launches kernels."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype=torch.float32,
        ranks: RankInfo = RankInfo(),
        moe_impl: str = "torch",
        kernels: KernelConfig = KernelConfig(),
    ):
        super().__init__()
        self.config, self.ranks = cfg, ranks
        check_unquantized(cfg, "lm_head")
        self.model = DeepseekV3Model(cfg, ranks, dtype, moe_impl)
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, rank=ranks.rank, size=ranks.world_size, dtype=dtype
        )
        self.aux_layer_ids: tuple[int, ...] = ()
        use_kernels(self, kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch):
        residual = self.model.embed_tokens(input_ids)  # [T, D]: the stream entering layer 0
        cos, sin = self.model.rotary(positions)  # [T, P/2] each, fp32
        layers = self.model.layers
        norms = [layer.input_layernorm for layer in layers] + [self.model.norm]  # norms[i]: the one before layer i
        x, aux = norms[0](residual), {}
        for i, layer in enumerate(layers):
            if i in self.aux_layer_ids:
                aux[i] = residual  # the stream entering layer i
            x, residual = layer(x, residual, cos, sin, batch, norms[i + 1])
        if len(layers) in self.aux_layer_ids:
            aux[len(layers)] = residual  # the final pre-norm stream
        if self.aux_layer_ids == (-1,):  # the MTP draft's: the final normed hidden itself, no copy
            return x, x
        aux[-1] = x  # the final normed hidden (what lm_head reads)
        return (x, torch.cat([aux[i] for i in self.aux_layer_ids], dim=-1)) if self.aux_layer_ids else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
