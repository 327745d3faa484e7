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
from dataclasses import dataclass

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
    # MLASERVE_MOE_GEMV: 1-2 token MoE steps as grouped GEMVs (moe_gemv.py); "n1:w1:n2:w2" also sets their
    # rows per program and warps (gemv1, gemv2) for A/B timing
    moe_gemv: bool = True
    moe_gemv_tiles: tuple[int, int, int, int] | None = None
    # MLASERVE_MOE_PREWAIT: under PDL, GEMM2 of per-pair MoE steps reads the routing before its PDL wait
    moe_prewait: bool = True

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
    # FP8 checkpoints (linears and experts): steps of more than this many tokens quantize their activations per
    # token per 128 channels (W8A8, the checkpoint's `activation_scheme: dynamic`), smaller ones compute on them
    # as they are (W8A16). One edge for both, in tokens, at a prefill-graph bucket at or above every decode
    # graph's tokens (engine/cuda_graph.graph_safe_kernels raises it), so that a step padded into a CUDA graph and
    # its eager twin quantize alike: the two schemes differ by ~2% in the logits, enough to change greedy tokens
    fp8_a8_min_tokens: int = 256
    # FP8 linears: up to this many rows the W8A16 GEMV (kernels/fp8_gemv.py, at most its FP8_GEMV_MAX_ROWS); W8A8
    # steps of at least fp8_scaled_mm_min_rows rows go to torch's scaled_mm where it runs, else the Triton GEMM
    # (kernels_bench --only fp8_linear times every form at every row count)
    fp8_gemv_max_rows: int = 2
    fp8_scaled_mm_min_rows: int = 256
    # INT4 experts: the GEMV form (each pair streams its expert) while the pairs are at most int4_gemv_sharing x
    # the distinct experts they are expected to select and at most int4_gemv_max_pairs; else the grouped GEMM,
    # which reads an expert once for all its pairs but streams ~3x slower (kernels_bench --only int4_moe)
    int4_gemv_max_pairs: int = 1024
    int4_gemv_sharing: float = 3.0

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

    def __post_init__(self):
        for name in (
            "gemv_max_bytes",
            "gemv_serve_tokens",
            "head_gemv_max_tokens",
            "fuse_shared_max_tokens",
            "no_align_max_pairs",
            "router_splitk_max_tokens",
            "fp8_a8_min_tokens",
            "fp8_gemv_max_rows",
            "fp8_scaled_mm_min_rows",
            "int4_gemv_max_pairs",
            *(("moe_a2a_min_tokens",) if self.moe_a2a_min_tokens is not None else ()),
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
            moe_gemv=gemv != "0",
            moe_gemv_tiles=tiles,
            moe_prewait=on("MLASERVE_MOE_PREWAIT"),
            allreduce=env.get("MLASERVE_ALLREDUCE", "auto"),
        )

    def moe_gemv_config(self) -> bool | dict:
        """fused_experts' `gemv` for steps the GEMV form may serve: off, on, or on with moe_gemv's tiles."""
        if not self.moe_gemv:
            return False
        if self.moe_gemv_tiles is None:
            return True
        n1, w1, n2, w2 = self.moe_gemv_tiles
        return dict(gemv1=dict(BLOCK_N=n1, num_warps=w1), gemv2=dict(BLOCK_N=n2, num_warps=w2))


def use_kernels(module, kernels: KernelConfig) -> None:
    """Give every submodule of an nn.Module that launches kernels (those with a `kernels` attribute) this config."""
    for m in module.modules():
        if hasattr(m, "kernels"):
            m.kernels = kernels
