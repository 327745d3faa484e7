"""KernelConfig: the fast paths' switches and the thresholds that choose between paths, in one frozen object.

It is read once (`from_env`, the only place the MLASERVE_* kernel variables are read), carried by EngineConfig
(the same on every rank: the ranks receive rank 0's), logged at start, and passed down to the model, the attention
backend, the kernel call sites and the all-reduce. Kernel functions take the fields they need as keyword arguments
whose defaults are these defaults, so tests and benchmarks can call them directly. Tile shapes stay with their
kernels.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

ALLREDUCE_BACKENDS = ("auto", "nccl", "one_shot", "two_shot")


@dataclass(frozen=True)
class KernelConfig:
    # ---- switches: the environment turns each off with "0" (A/B timing) ----
    # MLASERVE_PDL: Triton kernels launched with programmatic dependent launch on sm_90+ (kernels/pdl.py), on one
    # GPU and on TP ranks alike (collectives launch without PDL and never release early: pdl.py says why it holds)
    pdl: bool = True
    # MLASERVE_ABSORB_STORE: decode-only steps of 1-2 tokens run the KV store inside absorb_q_rope's launch
    absorb_store: bool = True
    # MLASERVE_MOE_TMA: the MoE's decode GEMMs (BLOCK_M 16, 16-bit, sm_90+) load weight tiles by TMA
    moe_tma: bool = True
    # MLASERVE_FP8_MOE_TMA: the FP8 MoE's W8A8 GEMMs (prefill, sm_90+) read whole tiles by TMA, with x quantized
    # straight into the blocks' row order (kernels/fp8_moe.py); the same products in the same order as the
    # pointer form
    fp8_moe_tma: bool = True
    # MLASERVE_FP8_KV_B_A8: an FP8 checkpoint's kv_b_proj (held dequantized for the absorbed projections) also
    # keeps its FP8 form, and prefill steps that quantize their activations run it W8A8, as DeepSeek's and vLLM's
    # FP8 prefills do (layers/fp8_linear.py's Fp8ExpandedLinear; +1 byte a kv_b weight)
    fp8_kv_b_a8: bool = True
    # MLASERVE_MOE_GEMV: 1-2 token MoE steps as grouped GEMVs (moe_gemv.py); "n1:w1:n2:w2" also sets their
    # rows per program and warps (gemv1, gemv2) for A/B timing
    moe_gemv: bool = True
    moe_gemv_tiles: tuple[int, int, int, int] | None = None
    # MLASERVE_MOE_PREWAIT: under PDL, GEMM2 of per-pair MoE steps reads the routing before its PDL wait
    moe_prewait: bool = True
    # MLASERVE_PREFILL_GLUON: MLA's bf16 prefill attention (head dims 128 + 64, 128) on sm_90 runs the Gluon kernel
    # (kernels/prefill_attention_gluon.py: two warp-specialized warpgroups, each's softmax under MMAs); the same
    # bits as the Triton kernel
    prefill_gluon: bool = True
    # MLASERVE_ABSORBED_SUFFIX: plain decoding's steps of short suffixes over cached context (a prefix hit's next
    # turn) run as decode rows of 32 tokens in MLA's absorbed form, on suffix graphs (engine/suffix.py)
    absorbed_suffix: bool = True

    # ---- thresholds: which path a step of a given size takes ----
    # layers.linear: steps of 1..gemv_serve_tokens rows times weights of <= gemv_max_bytes go to the Triton GEMV
    # (kernels/gemv.py; at most its GEMV_MAX_TOKENS); kernels_bench lin_decode measures the crossover
    gemv_max_bytes: int = 128 << 20
    gemv_serve_tokens: int = 2
    # the absorbed projections: steps of 1..head_gemv_max_tokens tokens run the head GEMV, larger ones torch.bmm
    # (at most kernels/head_gemv.py's HEAD_GEMV_MAX_TOKENS); kernels_bench absorb measures it
    head_gemv_max_tokens: int = 2
    # DeepseekV3MoE: steps of up to this many tokens run the shared experts inside the fused MoE (Triton, no EP);
    # a decode-graph batch size, so a padded graph step and its eager twin take the same path
    # (kernels_bench --only moe_shared measures the crossover)
    fuse_shared_max_tokens: int = 32
    # fused MoE: up to this many (token, k) pairs each pair is its own block (no align launch; the GEMV form)
    no_align_max_pairs: int = 16
    # routing: bf16 steps of up to this many tokens run the router GEMM as split-K partials summed by the routing
    router_splitk_max_tokens: int = 32
    # FP8 checkpoints: steps of more than an edge's tokens quantize their activations per token per 128 channels
    # (W8A8, the checkpoint's `activation_scheme: dynamic`), smaller ones compute on them as they are (W8A16).
    # A step padded into a CUDA graph and its eager twin must quantize alike (the two schemes differ by ~2% in the
    # logits, enough to change greedy tokens): engine/cuda_graph.graph_safe_kernels moves each edge off the inside
    # of a decode graph's batch sizes, and a prefill graph takes only steps on its bucket's side of both edges.
    # The experts' edge sits at a prefill-graph bucket at or above every decode graph's tokens (graph_safe_kernels
    # raises it): their W8A16 forms stream the weights at decode sizes.
    fp8_a8_min_tokens: int = 256
    # The dense linears' edge (kv_b_proj's prefill product included): their W8A16 GEMV serves 1-2 rows; from 3
    # rows W8A8 (scaled_mm's cuBLAS kernels, or the Triton GEMM) reads the weight faster than the W8A16 tiles
    # (kernels_bench --only fp8_linear)
    fp8_linear_a8_min_tokens: int = 2
    # FP8 linears: up to this many rows the W8A16 GEMV (kernels/fp8_gemv.py, at most its FP8_GEMV_MAX_ROWS); W8A8
    # steps of more than fp8_scaled_mm_min_rows rows, or on a weight of at least fp8_scaled_mm_min_bytes, go to
    # torch's scaled_mm where it runs, else the Triton GEMM (kernels_bench --only fp8_linear times every form at
    # every row count: on small weights at few rows the Triton GEMM is the faster). The two forms' sums differ in
    # order, and W8A8 carries that into the next layer's e4m3 codes: the row edge is kept off the inside of a CUDA
    # graph's sizes as the activation edges are (graph_safe_kernels)
    fp8_gemv_max_rows: int = 2
    fp8_scaled_mm_min_rows: int = 256
    fp8_scaled_mm_min_bytes: int = 24 << 20
    # INT4 experts: the GEMV form (each pair streams its expert) while the pairs are at most int4_gemv_sharing x
    # the distinct experts they are expected to select and at most int4_gemv_max_pairs; else the grouped GEMM,
    # which reads an expert once for all its pairs but dequantizes more slowly. The two break even near 1.8 pairs
    # an expert, alike at Kimi-K2.5's whole expert, its MoE-TP shards and an EP rank (docs/kernels.md)
    int4_gemv_max_pairs: int = 1024
    int4_gemv_sharing: float = 2.0

    # ---- the all-reduce under TP ----
    # MLASERVE_ALLREDUCE: auto (by message size, distributed/allreduce.py), nccl, or one_shot / two_shot (that
    # symmetric-memory path up to its buffer), for A/B timing
    allreduce: str = "auto"

    # ---- expert parallelism (ep_size > 1) ----
    # eager steps of at least this many tokens dispatch each token to the ranks owning its experts and combine the
    # results by all-to-all (layers/moe_a2a.py); smaller ones (and every CUDA-graph step: the split sizes need a
    # host sync) compute each rank's experts for every token and all-reduce. None (the default until the crossover
    # is measured on GPUs: benchmarks/ep_a2a_bench.py): never. `--moe-a2a-min-tokens`
    moe_a2a_min_tokens: int | None = None

    # ---- deterministic inference (`--deterministic-inference`; set by `batch_invariant()`) ----
    # on: every switch above that picks a form by the step's size is pinned to one form, so that a row's reduction
    # order depends on the row alone (DETERMINISTIC_PINS; NOT_YET_INVARIANT lists what configuration cannot fix)
    deterministic: bool = False
    # MLA decode: None, the split count from the batch (mla_decode.default_num_splits) and the tiles from the
    # program count; a number, that many splits whatever the batch, with the split kernel's default tiles, each
    # split at least mla_split_tokens long: the cut then depends on the sequence's length alone
    mla_num_splits: int | None = None
    mla_split_tokens: int | None = None

    def __post_init__(self):
        for name in (
            "gemv_max_bytes",
            "gemv_serve_tokens",
            "head_gemv_max_tokens",
            "fuse_shared_max_tokens",
            "no_align_max_pairs",
            "router_splitk_max_tokens",
            "fp8_a8_min_tokens",
            "fp8_linear_a8_min_tokens",
            "fp8_gemv_max_rows",
            "fp8_scaled_mm_min_rows",
            "fp8_scaled_mm_min_bytes",
            "int4_gemv_max_pairs",
            *(("moe_a2a_min_tokens",) if self.moe_a2a_min_tokens is not None else ()),
            *(("mla_num_splits",) if self.mla_num_splits is not None else ()),
            *(("mla_split_tokens",) if self.mla_split_tokens is not None else ()),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"kernels.{name}: must be an integer >= 0, got {v!r}")
        if isinstance(self.int4_gemv_sharing, bool) or not (
            isinstance(self.int4_gemv_sharing, (int, float)) and self.int4_gemv_sharing > 0
        ):
            raise ValueError(f"kernels.int4_gemv_sharing: must be a number > 0, got {self.int4_gemv_sharing!r}")
        if self.allreduce not in ALLREDUCE_BACKENDS:
            raise ValueError(
                f"kernels.allreduce (MLASERVE_ALLREDUCE): must be one of {', '.join(ALLREDUCE_BACKENDS)}, "
                f"got {self.allreduce!r}"
            )
        if self.mla_num_splits == 0:
            raise ValueError("kernels.mla_num_splits: must be an integer >= 1 (or None), got 0")
        t = self.moe_gemv_tiles
        if t is not None and (len(t) != 4 or any(not isinstance(n, int) or n < 1 for n in t)):
            raise ValueError(f"kernels.moe_gemv_tiles: must be 4 positive integers (n1, w1, n2, w2), got {t!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KernelConfig:
        """The defaults, with the MLASERVE_* switches of `env` (default: os.environ) applied."""
        env = os.environ if env is None else env

        def on(name: str) -> bool:
            return env.get(name, "1") != "0"

        gemv = env.get("MLASERVE_MOE_GEMV", "1")
        tiles = None
        if gemv not in ("0", "1"):
            try:
                tiles = tuple(int(v) for v in gemv.split(":"))
            except ValueError:
                tiles = ()
            if len(tiles) != 4:
                raise ValueError(f'MLASERVE_MOE_GEMV: must be "0", "1" or "n1:w1:n2:w2" (integers), got {gemv!r}')
        return cls(
            pdl=on("MLASERVE_PDL"),
            absorb_store=on("MLASERVE_ABSORB_STORE"),
            moe_tma=on("MLASERVE_MOE_TMA"),
            fp8_moe_tma=on("MLASERVE_FP8_MOE_TMA"),
            fp8_kv_b_a8=on("MLASERVE_FP8_KV_B_A8"),
            moe_gemv=gemv != "0",
            moe_gemv_tiles=tiles,
            moe_prewait=on("MLASERVE_MOE_PREWAIT"),
            prefill_gluon=on("MLASERVE_PREFILL_GLUON"),
            absorbed_suffix=on("MLASERVE_ABSORBED_SUFFIX"),
            allreduce=env.get("MLASERVE_ALLREDUCE", "auto"),
        )

    def batch_invariant(self) -> KernelConfig:
        """This config in deterministic mode: each threshold that picks a kernel form by the step's token count
        pinned so that every step takes one form (DETERMINISTIC_PINS), the MLA decode cut fixed, the MoE tiles
        fixed (moe_fixed_config). The switches that change no result (pdl, moe_tma, fp8_moe_tma, moe_prewait,
        prefill_gluon) are kept."""
        return replace(self, deterministic=True, **DETERMINISTIC_PINS)

    def moe_fixed_config(self) -> dict | None:
        """fused_experts' `config` in deterministic mode: the tiled GEMMs with one tile config for every step
        (moe_config's 64-row band: BLOCK_K 64, no split-K), no per-pair blocks, no GEMV form, except that decode-sized
        steps on the GPU take the default 16-row tiles, which give the same bits (decode_tiles); None otherwise."""
        if not self.deterministic:
            return None
        gemm = dict(BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
        return dict(
            no_align=False,
            gemv=False,
            decode_tiles=True,
            tma=False,
            BLOCK_M=64,
            gemm1=dict(gemm, BLOCK_N=64),
            gemm2=dict(gemm, BLOCK_N=128),
        )

    def int4_fixed_config(self) -> dict | None:
        """The INT4 experts' grouped GEMM tiles in deterministic mode (int4_moe.form_tiles): one config for both
        GEMMs at every step (int4_moe.gemm_config's up-to-24-rows tiles: 32-row blocks as wgmma's n32, BLOCK_K
        128); None otherwise."""
        if not self.deterministic:
            return None
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, TRANS=True)

    def mla_decode_args(self) -> tuple[int | None, dict | None]:
        """mla_decode's (num_splits, config): (None, None) by default (both from the batch); in deterministic mode
        the fixed split count and tiles (pointer loads with the default tiles: TMA and the few-program tiles are
        picked by the batch's program count) with each split at least mla_split_tokens long."""
        if self.mla_num_splits is None:
            return None, None
        cfg = dict(TMA=False, FEW=False)
        if self.mla_split_tokens is not None:
            cfg["MIN_SPLIT_TOKENS"] = self.mla_split_tokens
        return self.mla_num_splits, cfg

    def deterministic_summary(self) -> str:
        """The start-up log line of deterministic mode: what it pins and what is not yet invariant."""
        pins = ", ".join(f"{k}={getattr(self, k)}" for k in DETERMINISTIC_PINS)
        return (
            f"deterministic inference: pinned {pins}; MoE tiles {self.moe_fixed_config()}; "
            f"not yet batch-invariant: {'; '.join(NOT_YET_INVARIANT)}"
        )

    def moe_gemv_config(self) -> bool | dict:
        """fused_experts' `gemv` for steps the GEMV form may serve: off, on, or on with moe_gemv's tiles."""
        if not self.moe_gemv:
            return False
        if self.moe_gemv_tiles is None:
            return True
        n1, w1, n2, w2 = self.moe_gemv_tiles
        return dict(gemv1=dict(BLOCK_N=n1, num_warps=w1), gemv2=dict(BLOCK_N=n2, num_warps=w2))


# What deterministic mode sets (KernelConfig.batch_invariant): every step, whatever its size, takes the same form;
# with `deterministic` on, the dense GEMMs these leave (linears, lm_head, router, absorbed projections, kv_b_proj
# over a prefill's context) run on kernels/bi_gemm instead of cuBLAS.
DETERMINISTIC_PINS = dict(
    gemv_serve_tokens=0,  # no Triton GEMV for 1-2 rows: every dense step bi_gemm's one tiled form
    head_gemv_max_tokens=0,  # absorbed projections by bi_gemm at every size (and so no fused absorb + store)
    absorb_store=False,
    fuse_shared_max_tokens=1 << 62,  # the shared experts inside the fused MoE (its pinned tiles) at every size
    no_align_max_pairs=0,  # the MoE: aligned blocks at every size
    moe_gemv=False,  # ... never the grouped GEMV form
    router_splitk_max_tokens=0,  # the router GEMM in one piece, never split-K
    fp8_gemv_max_rows=0,  # FP8 linears: never the W8A16 GEMV
    fp8_a8_min_tokens=0,  # FP8: W8A8 (per-token activation scales: a row's own) at every size
    fp8_linear_a8_min_tokens=0,
    fp8_scaled_mm_min_rows=1 << 62,  # FP8: the Triton GEMM, never scaled_mm (cuBLAS picks by M)
    fp8_scaled_mm_min_bytes=1 << 62,
    int4_gemv_max_pairs=0,  # INT4 experts: the grouped GEMM at every size
    moe_a2a_min_tokens=None,  # EP: never the all-to-all form
    mla_num_splits=32,  # MLA decode: 32 splits whatever the batch ...
    mla_split_tokens=64,  # ... of >= 64 tokens: fixed 64-token chunks up to 2k context, 32 equal ones beyond
)

# Kernels whose reduction order still depends on the step in deterministic mode: configuration cannot fix them.
NOT_YET_INVARIANT = (
    "FP8 linears and experts (fp8_gemm's SPLIT_K and tiles by M; the grouped GEMM's tiles by rows per expert)",
    "a linear whose weight's dtype is not its input's (cuBLAS; logged once per shape)",
    "the EAGLE3 draft's own lm_head GEMM (cuBLAS; it changes which tokens are proposed, not the output)",
    "the torch reference backends on the GPU (--attention-backend torch, --moe-backend torch: cuBLAS GEMMs)",
)


def use_kernels(module, kernels: KernelConfig) -> None:
    """Give every submodule of an nn.Module that launches kernels (those with a `kernels` attribute) this config."""
    for m in module.modules():
        if hasattr(m, "kernels"):
            m.kernels = kernels
