"""kernels_bench's FP8 sections (fp8_linear, fp8_moe): DeepSeek-V3's block-scaled FP8 linears and MoE in every form,
beside bf16 (cuBLAS, our GEMV, our fused MoE) at the same shape in the same run.

    PYTHONPATH=$PWD python benchmarks/kernels_bench.py --only fp8_linear,fp8_moe --time-limit 900
    FP8_BENCH_M=1,2,4,8192 FP8_BENCH_T=1,2,8192 FP8_BENCH_SHAPES=q_a,o_proj,ds-v3 ...   # a subset

FP8_BENCH_M / FP8_BENCH_T: the row counts of the linears / token counts of the MoE; FP8_BENCH_SHAPES: names (or
their beginnings) of the LINEARS and MOES to run.

Rows: time, bytes or FLOPs (decode-sized steps are weight streams: the bytes read, fp8 weights plus scales, and
TB/s; larger steps FLOPs and TFLOP/s), and the error against the fp32 reference of the form (W8A8 forms against the
reference that quantizes x the same way). Small weights are timed over enough copies in turn (and the MoE over
several routings) that they stream from HBM, not L2 (triton's graph timing does not flush it).
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from benchmarks.bench_util import BF, Report, Sizes, bench, cfg_label, rel

L2_BYTES = 200 << 20  # time over weight copies until a call's working set is well past the H200's 50 MB L2

# (name, N, K): DeepSeek-V3's FP8 linears on one GPU; "expert" is the issue's anchor shape (7168 -> 2048)
LINEARS = (
    ("q_a|kv_a", 2112, 7168),
    ("kv_a", 576, 7168),
    ("q_b", 24576, 1536),
    ("o_proj", 7168, 16384),
    ("expert 7168->2048", 2048, 7168),
    ("dense gate|up", 36864, 7168),
    ("dense down", 7168, 18432),
)
LINEAR_M = (1, 2, 4, 8, 32, 256, 2048, 8192)
# (name, D, I, E local, E total, K): the full experts, MoE-TP8's shard, EP8's rank 0
MOES = (
    ("ds-v3", 7168, 2048, 256, 256, 8),
    ("ds-v3 tp8", 7168, 256, 256, 256, 8),
    ("ds-v3 ep8", 7168, 2048, 32, 256, 8),
)
MOE_T = (1, 2, 4, 8, 16, 32, 64, 256, 2048, 8192)
# fp8_gemv tiles (rows a program, columns a trip, warps) timed beside the default on these shapes, at 1-4 rows
GEMV_SWEEP = ((2, 1024, 4), (8, 1024, 4), (4, 2048, 8), (4, 512, 2), (8, 512, 2), (16, 512, 2))
GEMV_SWEEP_SHAPES = ("q_a|kv_a", "o_proj", "dense gate|up")
# W8A8 grouped-GEMM tiles beside the default at an 8192-token prefill (64-row blocks, GEMM1 64 wide on 4 warps);
# FP8_BENCH_A8_TILES (a JSON list of fp8_moe_config overrides) replaces them
MOE_A8_SWEEP = (
    dict(gemm1=dict(BLOCK_N=128, num_warps=8)),  # GEMM1 quantizing its own h group (the default before 2026-12-03)
    dict(gemm1=dict(num_stages=4)),
    dict(gemm1=dict(num_warps=8)),
)
# fp8_moe_gemv tiles ((rows, columns, warps) of gemv1, of gemv2) beside the default, at T = 1 and 2
MOE_GEMV_SWEEP = (
    ((2, 1024, 4), (4, 1024, 4)),
    ((4, 512, 2), (8, 512, 2)),
    ((4, 1024, 4), (8, 1024, 4)),
    ((2, 512, 2), (4, 2048, 8)),
)
GEMM_SWEEP = (
    dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=4),
    dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=2, num_stages=5),
    dict(BLOCK_M=32, BLOCK_N=128, SPLIT_K=1),
    dict(BLOCK_M=64, BLOCK_N=64, SPLIT_K=2),
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3),
)


def _env_ints(name: str, default: tuple) -> tuple:
    v = os.environ.get(name)
    return tuple(int(x) for x in v.split(",")) if v else default


def _picked(shapes: tuple) -> tuple:
    only = os.environ.get("FP8_BENCH_SHAPES")
    return tuple(s for s in shapes if not only or any(s[0].startswith(o) for o in only.split(",")))


def _sizes(sz: Sizes):
    if sz.dev == "cuda":
        return _picked(LINEARS), _env_ints("FP8_BENCH_M", LINEAR_M), _picked(MOES), _env_ints("FP8_BENCH_T", MOE_T)
    return (("tiny", 64, 200),), (1, 2, 9), (("tiny", 128, 64, 4, 4, 2),), (1, 12)  # --smoke: every path, briefly


def _copies(nbytes: int, sz: Sizes) -> int:
    return max(1, min(16, -(-L2_BYTES // nbytes))) if sz.dev == "cuda" else 1


def _timed(fn, weights, sz: Sizes) -> float:
    """fn(w) over the weight copies in turn, per call."""
    return bench(lambda: [fn(w) for w in weights], sz) / len(weights)


def _linear_variants(name: str, M: int) -> list:
    """(label, fp8_block_linear config or None for the bf16 baselines) at one shape and row count."""
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.fp8_gemv import FP8_GEMV_MAX_ROWS
    from mlaserve.kernels.gemv import GEMV_MAX_TOKENS

    out = [("bf16 F.linear (cuBLAS)", None)] + ([("bf16 gemv", None)] if M <= GEMV_MAX_TOKENS else [])
    forms = [{}, dict(form="triton", a8=False), dict(form="triton", a8=True), dict(form="scaled_mm")]  # {}: default
    if KernelConfig.fp8_gemv_max_rows < M <= FP8_GEMV_MAX_ROWS:
        forms.append(dict(form="gemv"))  # the GEMV where it is not the default (rows 3-4)
    if name in GEMV_SWEEP_SHAPES and M <= FP8_GEMV_MAX_ROWS:
        forms += [dict(form="gemv", BLOCK_N=n, BLOCK_K=k, num_warps=w) for n, k, w in GEMV_SWEEP]
    if name.startswith("expert") and M in (8, 32, 256, 2048):
        forms += [dict(t, form="triton", a8=a8) for t in GEMM_SWEEP for a8 in (False, True)]
    return out + [(f"fp8 {_label(c)}", c) for c in forms]


def _label(c: dict) -> str:
    """{"form": "triton", "a8": True, "BLOCK_M": 16} -> "triton a8 M16"; {} -> "default"."""
    head = [c["form"]] if "form" in c else []
    head += ["a8"] if c.get("a8") else ["a16"] if "a8" in c else []
    tiles = {k: v for k, v in c.items() if k not in ("form", "a8")}
    return " ".join(head + ([cfg_label(tiles)] if tiles else [])) or "default"


def run_fp8_linear(rep: Report, sz: Sizes):
    from mlaserve.kernels.fp8_linear import fp8_act_quant, fp8_block_linear, linear_form
    from mlaserve.kernels.fp8_reference import dequant_fp8_block, fp8_act_dequant, fp8_act_quant_ref, make_fp8_weight
    from mlaserve.kernels.gemv import gemv

    linears, Ms, _, _ = _sizes(sz)
    for name, N, K in linears:
        w8, s8 = make_fp8_weight(N, K, device=sz.dev)
        wf = dequant_fp8_block(w8, s8)  # fp32
        n = _copies(N * K, sz)
        fp8s = [(w8, s8)] + [(w8.clone(), s8.clone()) for _ in range(n - 1)]
        bfs = [wf.to(BF) for _ in range(n)]
        for M in Ms:
            x = torch.randn(M, K, device=sz.dev).to(BF)
            refs = {False: x.float() @ wf.T, True: fp8_act_dequant(*fp8_act_quant_ref(x)) @ wf.T}
            extra = dict(shape=name, N=N, K=K, M=M)
            io = M * K * 2 + M * N * 2
            for label, cfg in _linear_variants(name, M):
                if cfg is None:  # bf16
                    fn = (lambda w: F.linear(x, w)) if "cuBLAS" in label else (lambda w: gemv(x, w))  # noqa: B023
                    ws, a8, nbytes = bfs, False, N * K * 2
                else:
                    try:
                        a8 = linear_form(x, w8, s8, cfg)[1]
                    except ValueError:
                        continue
                    fn = lambda w, c=cfg: fp8_block_linear(x, *w, config=c)  # noqa: B023, E731
                    ws, nbytes = fp8s, N * K + s8.numel() * 4
                case = f"{name} [{N},{K}] M={M} {label}"
                ex = refs[False] if a8 else None
                flops = 2.0 * M * N * K
                _add(rep, "fp8_linear", case, fn, ws, refs[a8], sz, nbytes + io, flops, M <= 32, ex, **extra)
            qbytes = M * K * 3 + M * -(-K // 128) * 4
            case = f"{name} [{N},{K}] M={M} fp8_act_quant alone"
            _add(rep, "fp8_linear", case, lambda w: fp8_act_quant(x), [None], None, sz, qbytes, 0.0, True, **extra)  # noqa: B023
        fp8s = bfs = wf = None
        if sz.dev == "cuda":
            torch.cuda.empty_cache()


def _add(rep, kernel, case, fn, ws, ref, sz, nbytes, flops, decode, exact=None, **extra):
    """One row: the error of fn(ws[0]) against ref (None: no check), the time over ws in turn; bytes (decode) or
    FLOPs. exact (W8A8 forms): the unquantized-activation reference too, its error appended to the case as "vs
    exact" (what the quantization of x and h costs; the relerr column holds the kernel to its own maths). A form
    that fails (a torch without scaled_mm's blockwise scaling, a tile out of resources) prints."""
    try:
        out = fn(ws[0])
        err = None if ref is None else rel(out, ref)
        if exact is not None:
            extra["err_vs_exact"] = rel(out, exact)
            case = f"{case} [vs exact {extra['err_vs_exact']:.1e}]"
        ms = _timed(fn, ws, sz)
        rep.add(kernel, case, ms, nbytes if decode else 0.0, 0.0 if decode else flops, err=err, **extra)
    except Exception as e:
        print(f"{kernel} {case}: {type(e).__name__}: {str(e)[:160]}")


def _moe_variants(name: str, T: int, K: int) -> list:
    """(label, fp8_fused_experts config, or None for bf16 fused_experts) at one shape and token count."""
    out = [("bf16 fused_experts", None), ("fp8 default", {})]  # T*K <= 16: the GEMV form
    out += [(f"fp8 tiled a8={a8}", dict(gemv=False, a8=a8)) for a8 in (False, True)]
    if T * K <= 16:
        for g1, g2 in MOE_GEMV_SWEEP:
            c = {f"gemv{i}": dict(BLOCK_N=n, BLOCK_K=k, num_warps=w) for i, (n, k, w) in ((1, g1), (2, g2))}
            out.append((f"fp8 gemv N{g1[0]} K{g1[1]} w{g1[2]} / N{g2[0]} K{g2[1]} w{g2[2]}", dict(gemv=c)))
    if name == "ds-v3" and T == 8192:
        sweep = json.loads(os.environ["FP8_BENCH_A8_TILES"]) if os.environ.get("FP8_BENCH_A8_TILES") else MOE_A8_SWEEP
        out += [(f"fp8 tiled a8=True {c}", dict(c, gemv=False, a8=True)) for c in sweep]
    if name == "ds-v3" and T in (16, 64, 2048, 8192):
        tiles = (
            dict(BLOCK_M=32),
            dict(BLOCK_M=128, gemm1=dict(BLOCK_N=64)),
            dict(gemm2=dict(BLOCK_N=256, num_warps=8)),
        )
        for c in tiles:
            for a8 in (False, True):
                out.append((f"fp8 tiled a8={a8} {c}", dict(c, gemv=False, a8=a8)))
    return out


def run_fp8_moe(rep: Report, sz: Sizes):
    from mlaserve.kernels.fp8_moe import fp8_fused_experts, moe_form
    from mlaserve.kernels.fp8_reference import dequant_fp8_block, fp8_fused_experts_ref
    from mlaserve.kernels.fused_moe import fused_experts
    from tests.helpers.fp8_checks import make_fp8_experts, moe_routing

    _, _, moes, Ts = _sizes(sz)
    routings = 4 if sz.dev == "cuda" else 1  # a new routing a call: the experts' weights come from HBM
    for name, D, I, E, E_total, K in moes:
        w13, s13, w2, s2 = make_fp8_experts(sz.dev, E=E, D=D, I=I)
        w13b = torch.empty(E, 2 * I, D, dtype=BF, device=sz.dev)
        w2b = torch.empty(E, D, I, dtype=BF, device=sz.dev)
        for e in range(E):
            w13b[e] = dequant_fp8_block(w13[e], s13[e], half_rows=I).to(BF)
            w2b[e] = dequant_fp8_block(w2[e], s2[e]).to(BF)
        all_local = E == E_total
        for T in Ts:
            x = torch.randn(T, D, device=sz.dev).to(BF)
            rs = [moe_routing(sz.dev, T=T, K=K, E_total=E_total) for _ in range(routings)]
            local = [((ids >= 0) & (ids < E)) for ids, _ in rs]  # offset 0
            n_exp = sum(int(ids[m].unique().numel()) for (ids, _), m in zip(rs, local)) / routings
            pairs = sum(int(m.sum()) for m in local) / routings
            ids0, w0 = rs[0]
            refs = {a8: fp8_fused_experts_ref(x, w13, s13, w2, s2, w0, ids0, a8=a8) for a8 in (False, True)}
            scale_bytes = (s13[0].numel() + s2[0].numel()) * 4
            for label, cfg in _moe_variants(name, T, K):
                if cfg is None:
                    fn = lambda r: fused_experts(x, w13b, w2b, r[1], r[0], 0, all_local=all_local)  # noqa: B023, E731
                    a8, wbytes = False, 3 * D * I * 2
                else:
                    fn = lambda r, c=cfg: fp8_fused_experts(  # noqa: E731
                        x,
                        w13,
                        s13,
                        w2,
                        s2,
                        r[1],
                        r[0],
                        all_local=all_local,
                        config=c,  # noqa: B023
                    )
                    a8, wbytes = moe_form(T, K, E, cfg, dtype=BF)[2], 3 * D * I + scale_bytes
                nbytes = n_exp * wbytes + 2 * T * D * 2
                case = f"{name} T={T} experts={n_exp:.0f} {label}"
                extra = dict(shape=name, T=T, experts=n_exp, form=label)
                ex = refs[False] if a8 else None
                _add(rep, "fp8_moe", case, fn, rs, refs[a8], sz, nbytes, 6.0 * pairs * D * I, T <= 64, ex, **extra)
        w13 = w2 = w13b = w2b = None
        if sz.dev == "cuda":
            torch.cuda.empty_cache()
