"""compile_check's cases for deterministic mode (`--deterministic-inference`): bi_gemm at M1's linears, the lm_head
(fp32 logits) and the absorbed projections' per-head form; MLA decode with the fixed split cut; the fused MoE with
its fixed tiles. Each yields (label, fn, args) as compile_check.cases does."""

from __future__ import annotations

import functools

import torch


def deterministic_cases(quick: bool):
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.bi_gemm import bi_gemm
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.mla_decode import mla_decode

    bf, i32 = torch.bfloat16, torch.int32
    k = KernelConfig().batch_invariant()
    for N, K in [(3648, 2048), (2048, 2048), (22528, 2048), (2048, 11264)][: 2 if quick else None]:
        for M in (1, 4096):  # M is not specialized: one binary a tile (64x64 at M=1, 128x128 at 4096)
            yield (
                f"deterministic bi_gemm [{N}, {K}] M={M}",
                bi_gemm,
                (torch.empty(M, K, dtype=bf), torch.empty(N, K, dtype=bf)),
            )
    from benchmarks.decode_sweeps import loop_tiles

    for name, t in loop_tiles().items():  # kernels_bench's forced loop-form tiles
        yield (
            f"deterministic bi_gemm {name} [3648, 2048] M=8192",
            functools.partial(bi_gemm, tiles=t),
            (torch.empty(8192, 2048, dtype=bf), torch.empty(3648, 2048, dtype=bf)),
        )
    yield (
        "deterministic bi_gemm lm_head [163840, 2048] fp32 out",
        functools.partial(bi_gemm, out_dtype=torch.float32),
        (torch.empty(8, 2048, dtype=bf), torch.empty(163840, 2048, dtype=bf)),
    )
    yield (
        "deterministic bi_gemm fp32 (tests)",
        bi_gemm,
        (torch.empty(17, 64, dtype=torch.float32), torch.empty(48, 64, dtype=torch.float32)),
    )
    for H in (16, 128):  # absorbed: q_nope [T, H, 128] (a view of q [T, H, 192]) @ w_kc, o_lat @ w_vc into views
        T = 8
        kv_b = torch.empty(H * 256, 512, dtype=bf).view(H, 256, 512)  # [H, N+V, R]
        w_kc, w_vc = kv_b[:, :128], kv_b[:, 128:].transpose(1, 2)  # [H, 128, 512], [H, 512, 128]
        q = torch.empty(T, H, 192, dtype=bf)[..., :128]
        Q = torch.empty(T, H, 576, dtype=bf)[..., :512]
        o_lat, out = torch.empty(T, H, 512, dtype=bf), torch.empty(T, H * 128, dtype=bf).view(T, H, 128)
        yield (
            f"deterministic bi_gemm absorb_q H={H}",
            functools.partial(bi_gemm, out=Q.transpose(0, 1)),
            (q.transpose(0, 1), w_kc.transpose(1, 2)),
        )
        yield (
            f"deterministic bi_gemm absorb_out H={H}",
            functools.partial(bi_gemm, out=out.transpose(0, 1)),
            (o_lat.transpose(0, 1), w_vc.transpose(1, 2)),
        )
    splits, cfg = k.mla_decode_args()
    for B in (1, 64):
        yield (
            f"deterministic mla_decode H=16 B={B}",
            functools.partial(mla_decode, num_splits=splits, config=cfg),
            (
                torch.empty(B, 16, 576, dtype=bf),
                torch.empty(64, 64, 576, dtype=bf),
                torch.zeros(B, 8, dtype=i32),
                torch.ones(B, dtype=i32),
                1,
                0.1,
                torch.empty(B, 16, 512, dtype=bf),
            ),
        )
    E, D, I, K = 64, 2048, 1408, 6
    w13 = torch.empty(1, 2 * I, D, dtype=bf).expand(E, 2 * I, D)
    w2 = torch.empty(1, D, I, dtype=bf).expand(E, D, I)
    for T in (1, 512):
        yield (
            f"deterministic fused_moe moonlight T={T}",
            functools.partial(fused_experts, config=k.moe_fixed_config(), kernels=k),
            (torch.empty(T, D, dtype=bf), w13, w2, torch.empty(T, K), torch.zeros(T, K, dtype=torch.int64), 0),
        )
