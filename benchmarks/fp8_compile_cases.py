"""compile_check.py's cases for the FP8 block-scaled kernels (fp8_linear.py, fp8_moe.py) at DeepSeek-V3's shapes."""

from __future__ import annotations

import torch

F8 = torch.float8_e4m3fn
BF = torch.bfloat16

# (name, N, K): DeepSeek-V3's FP8 linears (q_a|kv_a fused, q_b, kv_b, o_proj, dense and shared MLPs), one GPU
LINEARS = (
    ("q_a|kv_a", 2112, 7168),
    ("kv_a", 576, 7168),
    ("q_b", 24576, 1536),
    ("kv_b", 32768, 512),
    ("o_proj", 7168, 16384),
    ("dense gate|up", 36864, 7168),
    ("dense down", 7168, 18432),
    ("shared down", 7168, 2048),
)


def _w(N: int, K: int):
    """A [N, K] e4m3 weight as a stride-0 view (real shape, one row of memory) and its [N/128, K/128] scales."""
    return torch.empty(1, K, dtype=F8).expand(N, K), torch.empty(-(-N // 128), -(-K // 128))


def _big(E: int, N: int, K: int, dtype=F8):
    return torch.empty(1, N, K, dtype=dtype).expand(E, N, K)


def fp8_cases(quick: bool):
    """Yields (label, fn, args) as compile_check.cases does."""
    import functools

    from mlaserve.kernels.fp8_linear import fp8_act_quant, fp8_block_linear
    from mlaserve.kernels.fp8_moe import fp8_fused_experts

    for name, N, K in LINEARS[:1] if quick else LINEARS:
        w, s = _w(N, K)
        for M in (1, 2, 32, 8192) if quick else (1, 2, 8, 32, 256, 8192):
            for a8 in (False, True) if M > 8 else (False,):
                yield (
                    f"fp8_block_linear {name} M={M} a8={a8}",
                    functools.partial(fp8_block_linear, config=dict(a8=a8) if M > 8 else None),
                    (torch.empty(M, K, dtype=BF), w, s),
                )
        if not quick:  # the GEMV at 3-4 rows (forced) and the tiles kernels_bench sweeps
            from benchmarks.fp8_bench import GEMV_SWEEP, GEMV_SWEEP_SHAPES

            sweep = [(4, None)] + [(1, dict(BLOCK_N=n, BLOCK_K=k, num_warps=wp)) for n, k, wp in GEMV_SWEEP]
            for M, tiles in sweep if name in GEMV_SWEEP_SHAPES else [(4, None)]:
                yield (
                    f"fp8_block_linear {name} M={M} gemv {tiles or ''}",
                    functools.partial(fp8_block_linear, config=dict(form="gemv", **(tiles or {}))),
                    (torch.empty(M, K, dtype=BF), w, s),
                )
    yield "fp8_act_quant M=8192 K=7168", fp8_act_quant, (torch.empty(8192, 7168, dtype=BF),)
    from mlaserve.kernels.fp8_quant import gather_rows
    from mlaserve.kernels.silu_mul import silu_mul_quant

    P = 65536 + 256 * 63  # DeepSeek-V3's 8,192 tokens x 8 in 64-row blocks, at most
    yield (
        f"fp8_act_quant sorted (gather_rows) P={P}",
        functools.partial(gather_rows, topk=8, M=8192),
        (
            torch.empty(8192, 7168, dtype=torch.float8_e4m3fn),
            torch.empty(56, 8192).t(),
            torch.zeros(P, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
        ),
    )
    for I in (2048, 18432):  # DeepSeek-V3's shared expert and dense MLP
        gu = torch.empty(8192, 2 * I, dtype=BF)
        yield f"fp8 silu_mul_quant T=8192 I={I}", functools.partial(silu_mul_quant, row_align=4), (gu[:, :I], gu[:, I:])
    for T in (1, 2, 4, 16, 64, 256, 8192):  # DeepSeek-V3's experts, 256 of them, top-8
        for a8 in (False, True) if T >= 16 else (None,):
            if quick and T not in (1, 8192):
                continue
            D, I, E, K = 7168, 2048, 256, 8
            cfg = None if a8 is None else dict(a8=a8)
            args = (
                torch.empty(T, D, dtype=BF),
                _big(E, 2 * I, D),
                _big(E, 2 * I // 128, D // 128, torch.float32),
                _big(E, D, I),
                _big(E, D // 128, I // 128, torch.float32),
                torch.empty(T, K),
                torch.zeros(T, K, dtype=torch.int64),
            )
            yield f"fp8_fused_experts T={T} a8={a8}", functools.partial(fp8_fused_experts, config=cfg), args
            if T == 1 and not quick:  # the GEMV tiles kernels_bench sweeps
                from benchmarks.fp8_bench import MOE_GEMV_SWEEP

                for g1, g2 in MOE_GEMV_SWEEP:
                    c = {f"gemv{i}": dict(BLOCK_N=n, BLOCK_K=k, num_warps=wp) for i, (n, k, wp) in ((1, g1), (2, g2))}
                    yield (
                        f"fp8_fused_experts T=1 gemv {g1} {g2}",
                        functools.partial(fp8_fused_experts, config=dict(gemv=c)),
                        args,
                    )
            if T == 8192 and a8 and not quick:  # the W8A8 tiles kernels_bench sweeps at prefill
                from benchmarks.fp8_bench import MOE_A8_SWEEP

                for c in MOE_A8_SWEEP:
                    yield (
                        f"fp8_fused_experts T=8192 a8 {c}",
                        functools.partial(fp8_fused_experts, config=dict(c, a8=True)),
                        args,
                    )
    # the W8A8 GEMMs' TMA form (forced: CPU tensors are never TMA's; 2 experts, since the descriptors need
    # contiguous weights, and the kernels take the expert count only at run time)
    D, I, E, K, T = 7168, 2048, 2, 8, 8192
    args = (
        torch.empty(T, D, dtype=BF),
        torch.empty(E, 2 * I, D, dtype=F8),
        torch.empty(E, 2 * I // 128, D // 128),
        torch.empty(E, D, I, dtype=F8),
        torch.empty(E, D // 128, I // 128),
        torch.empty(T, K),
        torch.zeros(T, K, dtype=torch.int64),
    )
    yield (
        "fp8_fused_experts T=8192 a8=True tma",
        functools.partial(fp8_fused_experts, config=dict(a8=True, tma=True)),
        args,
    )
