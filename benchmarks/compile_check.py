"""Compile every Triton kernel configuration the engine and kernels_bench use for sm_90 (H100/H200) on a machine
WITHOUT a GPU, and report shared memory, registers and spills per kernel (ptxas -v).

The wrappers run on CPU tensors as usual; a stand-in Triton driver reports an sm_90 target and launches become
no-ops, so each kernel goes through Triton's real front end, optimiser and ptxas exactly as on the H200.
Large weights are stride-0 expanded views, so real shapes cost no memory.

    PYTHONPATH=$PWD python benchmarks/compile_check.py [--quick] [--only fp8]

Exits non-zero if a kernel fails to compile, needs more than 227 KB of shared memory, spills more than
MAX_SPILL bytes of registers (the 8k prefill attention's fastest tiles, measured on the H200, spill 40 B), or has
its wgmmas serialized by ptxas (note C7515: each wgmma then waits for the one before it; int4_gemm.py says how one
such kernel was mended).

A refactor of kernel code is proven on CPU by identical PTX (debug lines and labels stripped), case by case:

    PYTHONPATH=$PWD python benchmarks/compile_check.py --sigs /tmp/before.json          # on the old code
    PYTHONPATH=$PWD python benchmarks/compile_check.py --against /tmp/before.json       # on the new: differences
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks.*
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_check needs compiled kernels: unset TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402

MAX_SHARED = 232448  # bytes per block on sm_90
MAX_SPILL = 64  # bytes; a few spilled registers in a compute-bound loop measured harmless (see the docstring)
RESULTS: list[dict] = []
SIGS: dict[str, str] = {}  # "case :: kernel" -> PTX signature (--sigs / --against)


class _Sm90Driver:
    """Just enough of a Triton driver to compile for sm_90 and skip the launch."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def map_python_to_cpp_type(self, ty):
        return ty


def _ptxas_usage(ptx: str) -> tuple[int, int, bool]:
    """(registers, spilled bytes, wgmmas serialized) from ptxas -v."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run(
            [knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True
        ).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else 0, "C7515" in out


def ptx_body(ptx: str) -> str:
    """The PTX without its debug information (line table, labels, comments), which moves with the source."""
    body = "\n".join(ln for ln in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp)", ln))
    return re.sub(r"\.section\s+\.debug.*", "", body, flags=re.S)


def ptx_signature(ptx: str) -> str:
    return hashlib.sha1(ptx_body(ptx).encode()).hexdigest()[:16]


DUMP_DIR = [None]  # --dump-ptx: each (case, kernel)'s PTX body, to diff two trees' kernels


def _dump(name: str, ptx: str) -> None:
    case = re.sub(r"[^A-Za-z0-9_.=-]+", "_", CURRENT_CASE[0])[:100]
    with open(os.path.join(DUMP_DIR[0], f"{case}__{name}.ptx"), "w") as f:
        f.write(ptx_body(ptx))


def _record_launch(self):
    md = self.metadata
    key = (self.name, self.hash)
    SIGS[f"{CURRENT_CASE[0]} :: {self.name}"] = ptx_signature(self.asm["ptx"])
    if DUMP_DIR[0]:
        _dump(self.name, self.asm["ptx"])
    if all(r["key"] != key for r in RESULTS):
        regs, spills, serial = _ptxas_usage(self.asm["ptx"])
        ptx = self.asm["ptx"]
        mma = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "-"
        pipe = "cp.async" if "cp.async" in ptx else "-"
        RESULTS.append(
            dict(
                key=key,
                name=self.name,
                warps=md.num_warps,
                stages=md.num_stages,
                shared=md.shared,
                regs=regs,
                spills=spills,
                serial=serial,
                mma=mma,
                pipe=pipe,
                case=CURRENT_CASE[0],
            )
        )
    return lambda *args, **kwargs: None


CURRENT_CASE = [""]


def _pdl_on_everywhere() -> None:
    """The engine launches with PDL on sm_90 (mlaserve/kernels/pdl.py); the wrappers here get CPU tensors, for
    which pdl_args says no: make every kernel module's pdl_args say yes, so the griddepcontrol code compiles."""
    import importlib
    import pkgutil

    import mlaserve.kernels as kernels

    for m in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"mlaserve.kernels.{m.name}")
        if hasattr(mod, "pdl_args"):
            mod.pdl_args = lambda t, pdl=True: dict(PDL=True, launch_pdl=True)


def install() -> None:
    from mlaserve.kernels import int4_gemm

    _pdl_on_everywhere()
    int4_gemm.BF2_ON_CPU = True  # the INT4 GEMMs' bf16-pair dequantization, as an sm_90 GPU takes it
    triton.runtime.driver.set_active(_Sm90Driver())
    CompiledKernel.run = property(_record_launch)
    CompiledKernel.launch_metadata = lambda self, *args: None


def big(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    """A [E, ...] weight of real shape backed by one expert's memory (stride 0 over E)."""
    return torch.empty(1, *shape[1:], dtype=dtype).expand(*shape)


def cases(quick: bool):
    from benchmarks.bench_util import PREFILL_SWEEP

    """Yields (label, fn, args): each call compiles the kernels one real configuration uses."""
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.mla_decode import mla_decode
    from mlaserve.kernels.prefill_attention import prefill_attention, prefill_attention_mla
    from mlaserve.kernels.rope_kv import rope_q, rope_store_kv
    from mlaserve.kernels.routing import route_noaux_tc_logits, router_partials

    bf, i32 = torch.bfloat16, torch.int32
    mla = [
        (16, 1, 16),
        (16, 2, 16),
        (64, 1, 16),
        (64, 2, 32),
        (128, 1, 1),
        (4, 2, 3),
        (16, 4, 8),
        (20, 1, 5),
        (17, 2, 3),
    ]  # (17, 2, 3): fp32 at R=512, as the gpu tests run it
    for H, q_len, B in mla:
        if quick and H != 16:
            continue
        R, P = (32, 8) if H == 4 else (512, 64)
        for dtype in [bf] if H not in (4, 17) else [bf, torch.float32] if H == 4 else [torch.float32]:
            T = B * q_len
            yield (
                f"mla_decode H={H} q_len={q_len} B={B} {dtype}",
                mla_decode,
                (
                    torch.empty(T, H, R + P, dtype=dtype),
                    torch.empty(64, 64, R + P, dtype=dtype),
                    torch.zeros(B, 8, dtype=i32),
                    torch.ones(B, dtype=i32),
                    q_len,
                    0.1,
                    torch.empty(T, H, R, dtype=dtype),
                ),
            )
            if dtype == bf and R == 512:  # the TMA tile loads, at the stage counts kernels_bench sweeps
                for stages in (2, 3, 4):
                    yield (
                        f"mla_decode TMA s{stages} H={H} q_len={q_len} B={B}",
                        functools.partial(mla_decode, config=dict(TMA=True, num_stages=stages)),
                        (
                            torch.empty(T, H, R + P, dtype=dtype),
                            torch.empty(64, 64, R + P, dtype=dtype),
                            torch.zeros(B, 8, dtype=i32),
                            torch.ones(B, dtype=i32),
                            q_len,
                            0.1,
                            torch.empty(T, H, R, dtype=dtype),
                        ),
                    )
    for H, q_len, B in [(16, 1, 1), (16, 1, 16), (16, 1, 32), (16, 2, 16), (128, 1, 4), (64, 4, 8)]:
        if quick and H != 16:
            continue
        T = B * q_len  # an FP8 latent cache (--kv-cache-dtype fp8): e4m3 tiles dequantized in registers
        for tma in (False, True) if B * H >= 64 else (False,):  # TMA: the engine's default from 4 programs
            yield (
                f"mla_decode fp8-kv {'TMA ' if tma else ''}H={H} q_len={q_len} B={B}",
                functools.partial(mla_decode, kv_scale=torch.ones(1), config=dict(TMA=True) if tma else None),
                (
                    torch.empty(T, H, 576, dtype=bf),
                    torch.empty(64, 64, 576, dtype=torch.float8_e4m3fn),
                    torch.zeros(B, 8, dtype=i32),
                    torch.ones(B, dtype=i32),
                    q_len,
                    0.1,
                    torch.empty(T, H, 512, dtype=bf),
                ),
            )
    for Dqk, Dv, dtype in [(192, 128, bf), (24, 24, bf), (24, 24, torch.float32), (192, 128, torch.float32)]:
        cu = torch.tensor([0, 64], dtype=i32)
        yield (
            f"prefill Dqk={Dqk} Dv={Dv} {dtype}",
            prefill_attention,
            (
                torch.empty(64, 16, Dqk, dtype=dtype),
                torch.empty(64, 16, Dqk, dtype=dtype),
                torch.empty(64, 16, Dv, dtype=dtype),
                cu,
                cu,
                0.1,
                torch.empty(64, 16, Dv, dtype=dtype),
                64,
            ),
        )
    mla_dims = [(128, 64, 128, bf), (16, 8, 24, bf), (16, 8, 24, torch.float32), (128, 64, 128, torch.float32)]
    for N, P, V, dtype in mla_dims:
        cu = torch.tensor([0, 64], dtype=i32)
        kv, latent = torch.empty(64, 16, N + V, dtype=dtype), torch.empty(64, 512 + P, dtype=dtype)
        q, out = torch.empty(64, 16, N + P, dtype=dtype), torch.empty(64, 16, V, dtype=dtype)
        for cfg in [None] if (quick or dtype != bf or N != 128) else [None, *PREFILL_SWEEP]:
            yield (
                f"prefill_mla N={N} P={P} V={V} {dtype} {cfg or ''}",
                prefill_attention_mla,
                (q, kv[..., :N], latent[:, 512:], kv[..., N:], cu, cu, 0.1, out, 64, cfg),
            )
    from mlaserve.kernels import prefill_attention_gluon

    if prefill_attention_gluon.AVAILABLE:  # the Gluon form (sm_90, bf16, MLA's dims), called past `supported`
        kv, latent = torch.empty(256, 16, 256, dtype=bf), torch.empty(256, 576, dtype=bf)
        q, out, cu = torch.empty(256, 16, 192, dtype=bf), torch.empty(256, 16, 128, dtype=bf), torch.tensor([0, 256])
        yield (
            "prefill_mla gluon N=128 P=64 V=128 bf16",
            prefill_attention_gluon.prefill_attention_mla_gluon,
            (q, kv[..., :128], latent[:, 512:], kv[..., 128:], cu.to(i32), cu.to(i32), 0.1, out, 256),
        )
    moe = [("moonlight", 2048, 1408, 64, 6), ("kimi-tp4", 7168, 512, 384, 8), ("tiny", 64, 32, 8, 2)]
    for name, D, I, E, K in moe:
        for T in [1, 8192] if quick else [1, 16, 64, 256, 1024, 8192]:
            if name == "tiny" and T > 64:
                continue
            for dtype in [bf] if name == "kimi-tp4" else [bf, torch.float32]:
                yield (
                    f"fused_moe {name} T={T} {dtype}",
                    fused_experts,
                    (
                        torch.empty(T, D, dtype=dtype),
                        big(E, 2 * I, D, dtype=dtype),
                        big(E, D, I, dtype=dtype),
                        torch.empty(T, K),
                        torch.zeros(T, K, dtype=torch.int64),
                        0,
                    ),
                )
                if T == 1:  # with the shared experts' output added in the sum
                    yield (
                        f"fused_moe {name} T=1 + add {dtype}",
                        fused_experts,
                        (
                            torch.empty(T, D, dtype=dtype),
                            big(E, 2 * I, D, dtype=dtype),
                            big(E, D, I, dtype=dtype),
                            torch.empty(T, K),
                            torch.zeros(T, K, dtype=torch.int64),
                            0,
                            None,
                            torch.empty(T, D, dtype=dtype),
                        ),
                    )
                if (
                    T <= 256
                ):  # shared-experts fusion (DeepseekV3MoE: up to KernelConfig.fuse_shared_max_tokens): S more experts
                    S = 2 if name == "moonlight" else 1
                    gu = torch.empty(2 * S * I, D, dtype=dtype)
                    yield (
                        f"fused_moe {name} T={T} + {S} shared {dtype}",
                        fused_experts,
                        (
                            torch.empty(T, D, dtype=dtype),
                            big(E, 2 * I, D, dtype=dtype),
                            big(E, D, I, dtype=dtype),
                            torch.empty(T, K + S),
                            torch.zeros(T, K + S, dtype=torch.int64),
                            0,
                            None,
                            None,
                            (gu[: S * I], gu[S * I :], torch.empty(D, S * I, dtype=dtype)),
                        ),
                    )
                    if T == 1 and dtype == bf and name != "tiny":  # TMA weights (the sm_90 decode default)
                        yield (
                            f"fused_moe {name} T=1, TMA weights",
                            fused_experts,
                            (  # no shared: no slot descriptors
                                torch.empty(T, D, dtype=dtype),
                                torch.empty(8, 2 * I, D, dtype=dtype),
                                torch.empty(8, D, I, dtype=dtype),
                                torch.empty(T, K),
                                torch.zeros(T, K, dtype=torch.int64),
                                0,
                                dict(tma=True),
                            ),
                        )
                        yield (
                            f"fused_moe {name} T=1 + {S} shared, TMA weights",
                            fused_experts,
                            (  # 8 experts: real
                                torch.empty(T, D, dtype=dtype),
                                torch.empty(8, 2 * I, D, dtype=dtype),  # tiles, less RAM
                                torch.empty(8, D, I, dtype=dtype),
                                torch.empty(T, K + S),
                                torch.zeros(T, K + S, dtype=torch.int64),
                                0,
                                dict(tma=True),
                                None,
                                (gu[: S * I], gu[S * I :], torch.empty(D, S * I, dtype=dtype)),
                            ),
                        )
    for name, D, I, K, S in [("moonlight", 2048, 1408, 6, 2), ("kimi-tp4", 7168, 512, 8, 1)]:
        gu = torch.empty(2 * S * I, D, dtype=bf)
        for T in (1, 2) if name == "moonlight" else (1,):  # the GEMV form of per-pair steps (moe_gemv.py)
            yield (
                f"fused_moe {name} T={T} + {S} shared, GEMV form",
                fused_experts,
                (
                    torch.empty(T, D, dtype=bf),
                    big(64, 2 * I, D, dtype=bf),
                    big(64, D, I, dtype=bf),
                    torch.empty(T, K + S),
                    torch.zeros(T, K + S, dtype=torch.int64),
                    0,
                    dict(gemv=True),
                    None,
                    (gu[: S * I], gu[S * I :], torch.empty(D, S * I, dtype=bf)),
                ),
            )
    yield from int4_moe_cases(quick)
    for E, G, TG, K in [(64, 1, 1, 6), (384, 1, 1, 8), (256, 8, 4, 8), (8, 2, 1, 2)]:
        yield f"routing E={E} G={G}", route_noaux_tc_logits, (torch.empty(4, E), torch.empty(E), K, G, TG, True, 2.5)
        yield (
            f"routing E={E} G={G} + shared",
            route_noaux_tc_logits,
            (torch.empty(4, E), torch.empty(E), K, G, TG, True, 2.5, 2 if E == 64 else 1, E),
        )
    for E, D, G, TG, K in [(64, 2048, 1, 1, 6), (256, 7168, 8, 4, 8)]:  # the decode router: split-K partials
        part = torch.empty(32, 4, E)
        x, w = torch.empty(4, D, dtype=bf), torch.empty(E, D, dtype=bf)
        yield f"router_partials E={E} D={D}", router_partials, (x, w)
        yield f"routing from partials E={E}", route_noaux_tc_logits, (part, torch.empty(E), K, G, TG, True, 2.5, 2, E)
    for R, P, H in [(512, 64, 16), (512, 64, 128), (32, 8, 4)]:
        cs = torch.empty(4, P // 2)
        yield (
            f"rope_store_kv R={R} P={P}",
            rope_store_kv,
            (
                torch.empty(8, 64, R + P, dtype=bf),
                torch.zeros(4, dtype=torch.int64),
                torch.empty(4, R, dtype=bf),
                torch.empty(4, R + P, dtype=bf)[:, R:],
                cs,
                cs,
            ),
        )
        if R == 512 and H == 16:  # the FP8 latent cache's store, with the kv_a norm fused in
            yield (
                f"rope_store_kv fp8-kv R={R} P={P}",
                functools.partial(rope_store_kv, kv_scale=torch.ones(1)),
                (
                    torch.empty(8, 64, R + P, dtype=torch.float8_e4m3fn),
                    torch.zeros(4, dtype=torch.int64),
                    torch.empty(4, R, dtype=bf),
                    torch.empty(4, R + P, dtype=bf)[:, R:],
                    cs,
                    cs,
                    torch.empty(R, dtype=bf),
                ),
            )
        q = torch.empty(4, H, 128 + P, dtype=bf)[..., 128:]
        yield f"rope_q H={H} P={P}", rope_q, (q, cs, cs, q)
    from mlaserve.kernels.argmax import argmax_rows
    from mlaserve.kernels.rope_kv import rope_cos_sin

    for T, scale in [(1, 1.0), (8192, 1.3466)]:
        yield (
            f"rope_cos_sin T={T} scale={scale}",
            rope_cos_sin,
            (torch.zeros(T, dtype=torch.int64), torch.empty(32), scale),
        )
    for B, dt in [(1, torch.float32), (64, torch.float32), (2, bf)]:
        yield f"argmax_rows B={B} {dt}", argmax_rows, (torch.empty(B, 163840, dtype=dt),)
    for B in (1, 32):  # a greedy decode graph's: over its input ids and into a host ring row picked on the device
        yield (
            f"argmax_rows B={B} ring",
            argmax_rows,
            (
                torch.empty(B, 163840),
                torch.empty(B, dtype=torch.int64),
                torch.empty(4, 32, dtype=torch.int64),
                torch.zeros(1, dtype=torch.int32),
            ),
        )
    from mlaserve.kernels.gemv import gemv

    for N, K in [(3648, 2048), (2048, 2048), (1000, 7168), (22528, 2048), (2048, 11264)]:
        yield f"gemv N={N} K={K}", gemv, (torch.empty(1, K, dtype=bf), torch.empty(N, K, dtype=bf))
    for T in (1, 2):  # the lm_head of batch-1-2 decode, fp32 logits (layers.embedding.ParallelLMHead)
        yield (
            f"gemv lm_head T={T}",
            gemv,
            (torch.empty(T, 2048, dtype=bf), big(163840, 2048), None, torch.empty(T, 163840)),
        )
    from mlaserve.kernels.head_gemv import absorb_q_rope, absorb_q_rope_store_kv, head_gemv

    for H in (16, 128):  # the absorbed projections, w_kc [H, 128, 512] and the transposed w_vc view [H, 512, 128]
        w = torch.empty(H, 256, 512, dtype=bf)
        for T in (1, 2):
            yield (
                f"head_gemv q H={H} T={T}",
                head_gemv,
                (torch.empty(T, H, 192, dtype=bf)[..., :128], w[:, :128], torch.empty(T, H, 576, dtype=bf)[..., :512]),
            )
            yield (
                f"head_gemv out H={H} T={T}",
                head_gemv,
                (torch.empty(T, H, 512, dtype=bf), w[:, 128:].transpose(1, 2), torch.empty(T, H, 128, dtype=bf)),
            )
            yield (
                f"absorb_q_rope H={H} T={T}",
                absorb_q_rope,
                (  # q: a view of the projection output
                    torch.empty(T, H * 192 + 576, dtype=bf)[:, : H * 192].view(T, H, 192),
                    w[:, :128],
                    torch.empty(T, 32),
                    torch.empty(T, 32),
                    torch.empty(T, H, 576, dtype=bf),
                ),
            )
            proj = torch.empty(T, H * 192 + 576, dtype=bf)  # [q | kv_a]: the KV store in the same launch
            yield (
                f"absorb_q_rope_store_kv H={H} T={T}",
                absorb_q_rope_store_kv,
                (
                    proj[:, : H * 192].view(T, H, 192),
                    w[:, :128],
                    torch.empty(T, 32),
                    torch.empty(T, 32),
                    torch.empty(T, H, 576, dtype=bf),
                    torch.empty(8, 64, 576, dtype=bf),
                    torch.zeros(T, dtype=torch.int64),
                    proj[:, H * 192 : H * 192 + 512],
                    proj[:, H * 192 + 512 :],
                    torch.empty(512, dtype=bf),
                    1e-6,
                ),
            )
            yield (
                f"absorb_q_rope_store_kv fp8-kv H={H} T={T}",
                functools.partial(absorb_q_rope_store_kv, kv_scale=torch.ones(1)),
                (
                    proj[:, : H * 192].view(T, H, 192),
                    w[:, :128],
                    torch.empty(T, 32),
                    torch.empty(T, 32),
                    torch.empty(T, H, 576, dtype=bf),
                    torch.empty(8, 64, 576, dtype=torch.float8_e4m3fn),
                    torch.zeros(T, dtype=torch.int64),
                    proj[:, H * 192 : H * 192 + 512],
                    proj[:, H * 192 + 512 :],
                    torch.empty(512, dtype=bf),
                    1e-6,
                ),
            )
    from mlaserve.kernels.gqa_decode import gqa_decode, gqa_store_kv
    from mlaserve.kernels.rmsnorm import add_rms_norm, rms_norm
    from mlaserve.kernels.silu_mul import silu_mul

    for D in (512, 2048, 7168):
        yield f"rms_norm D={D}", rms_norm, (torch.empty(4, D, dtype=bf), torch.empty(D, dtype=bf), 1e-6)
        yield (
            f"add_rms_norm D={D}",
            add_rms_norm,
            (torch.empty(4, D, dtype=bf), torch.empty(4, D, dtype=bf), torch.empty(D, dtype=bf), 1e-6),
        )
    from mlaserve.kernels.moe_sum import moe_sum

    for D, K in ((2048, 6), (7168, 8), (64, 2)):  # the MoE's sum over k with the next add + norm fused in
        for dtype in (bf, torch.float32):
            yield (
                f"moe_sum+norm D={D} K={K} {dtype}",
                moe_sum,
                (
                    torch.empty(4 * K, D, dtype=dtype),
                    torch.zeros(4, K, dtype=torch.int64),
                    0,
                    64,
                    torch.empty(4, D, dtype=dtype),
                    (torch.empty(D, dtype=dtype), 1e-6, torch.empty(4, D, dtype=dtype)),
                ),
            )
    for I in (1408, 2816, 18432):
        gu = torch.empty(4, 2 * I, dtype=bf)
        yield f"silu_mul I={I}", silu_mul, (gu[:, :I], gu[:, I:])
    gqa = [(64, 64, 128, 2, bf, 4), (64, 64, 128, 1, bf, 8), (16, 16, 128, 1, bf, 4), (4, 2, 16, 3, torch.float32, 4)]
    for H, KVH, d, q_len, dtype, B in gqa:  # Kimi-K2.5's draft at 8 requests: one split
        cache = torch.empty(8, 64, 2, KVH, d, dtype=dtype)
        T = B * q_len
        yield (
            f"gqa_decode H={H} kv={KVH} q_len={q_len} B={B} {dtype}",
            gqa_decode,
            (
                torch.empty(T, H, d, dtype=dtype),
                cache,
                torch.zeros(B, 8, dtype=i32),
                torch.full((B,), q_len, dtype=i32),
                q_len,
                0.1,
                torch.empty(T, H, d, dtype=dtype),
            ),
        )
        yield (
            f"gqa_store_kv kv={KVH} d={d}",
            gqa_store_kv,
            (
                cache,
                torch.zeros(T, dtype=torch.int64),
                torch.empty(T, KVH, d, dtype=dtype),
                torch.empty(T, KVH, d, dtype=dtype),
            ),
        )
    from mlaserve.kernels import spec_step

    for N in (2, 3, 4):  # a greedy speculative step's bookkeeping (K = 1-3 draft steps), as the warm-up compiles it
        yield f"spec_step N={N}", spec_step.warm_up, (N, 64, "cpu")
    from mlaserve.kernels import ngram

    for K, lo, hi in ((1, 1, 3), (3, 5, 5), (4, 1, 64)):  # NGRAM's lookup, as the proposer's warm-up compiles it
        i32 = dict(dtype=torch.int32)
        z = (torch.zeros(8, 4096, **i32), torch.zeros(8, 1024, **i32), torch.zeros(8, dtype=torch.int64))
        yield f"ngram K={K} lo={lo} hi={hi}", ngram.warm_up, (*z, torch.zeros(2, dtype=torch.int64), K + 1, K, lo, hi)
    from mlaserve.kernels.race_sample import race_sample

    for V in (8192, 129280, 163840):  # the default model's, DeepSeek-V3's, Kimi's and Moonlight's vocabularies
        for min_p in (False, True):
            for check in (False, True):
                yield (
                    f"race_sample V={V} min_p={min_p} check={check}",
                    race_sample,
                    (
                        torch.empty(4, V),
                        torch.empty(4, V),
                        torch.zeros(6, 4),
                        torch.empty(4, dtype=torch.int64),
                        min_p,
                        check,
                    ),
                )
    from benchmarks.deterministic_compile_cases import deterministic_cases
    from benchmarks.fp8_compile_cases import fp8_cases

    yield from deterministic_cases(quick)
    yield from fp8_cases(quick)


def int4_moe_cases(quick: bool):
    """The INT4 MoE (kernels/int4_moe.py) at Kimi-K2.5's expert shapes: the default tiles of each step size, the
    tiles kernels_bench --only int4_moe sweeps (full shape, at its 2048-token step), and an EP8 rank's."""
    from benchmarks.int4_moe_bench import GEMM_SWEEP, GEMV1_SWEEP, GEMV2_SWEEP, gemv2_variant
    from mlaserve.kernels.int4_moe import int4_fused_experts

    bf, i32 = torch.bfloat16, torch.int32
    for name, D, I in [("kimi", 7168, 2048), ("kimi-tp4", 7168, 512), ("kimi-tp8", 7168, 256)]:
        w = (big(384, 2 * I, D // 8, dtype=i32), big(384, 2 * I, D // 32), big(384, D, I // 8, dtype=i32))
        w = (*w, big(384, D, I // 32))
        cfgs = [None]
        if name == "kimi" and not quick:
            cfgs += [dict(form="gemv", gemv1=v) for v in GEMV1_SWEEP[1:]]
            cfgs += [dict(form="gemv", gemv2=gemv2_variant(v, D, I, 8)) for v in GEMV2_SWEEP[1:]]
            cfgs += [dict(form="gemm", gemm1=c, gemm2=c) for c in GEMM_SWEEP]
        for T in [1, 2048, 8192] if quick else [1, 2, 8, 32, 2048, 8192]:  # 8192: the transposed GEMMs' tiles
            for cfg in cfgs if T in (1, 2048) else [None]:
                if cfg and (cfg["form"] == "gemm") != (T == 2048):
                    continue
                yield (
                    f"int4_moe {name} T={T} {cfg or ''}",
                    functools.partial(int4_fused_experts, all_local=False, config=cfg),
                    (torch.empty(T, D, dtype=bf), *w, torch.empty(T, 8), torch.zeros(T, 8, dtype=torch.int64), 0),
                )
    # an EP8 rank (48 of 384 experts) at decode and verify steps: the tiles for the pairs it is expected to own
    w = (big(48, 4096, 896, dtype=i32), big(48, 4096, 224), big(48, 7168, 256, dtype=i32), big(48, 7168, 64))
    for T in [1, 2]:
        yield (
            f"int4_moe kimi-ep8 T={T} ",
            functools.partial(int4_fused_experts, all_local=False, num_experts=384),
            (torch.empty(T, 7168, dtype=bf), *w, torch.empty(T, 8), torch.zeros(T, 8, dtype=torch.int64), 0),
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the main bf16 configs only")
    ap.add_argument("--sigs", help="write every (case, kernel)'s PTX signature to this JSON file")
    ap.add_argument("--against", help="compare the PTX signatures with this --sigs file; differences fail")
    ap.add_argument("--only", help="only the cases whose label contains this string (e.g. fp8)")
    ap.add_argument("--dump-ptx", metavar="DIR", help="write each (case, kernel)'s PTX here (diff two trees' kernels)")
    args = ap.parse_args(argv)
    install()
    if args.dump_ptx:
        os.makedirs(args.dump_ptx, exist_ok=True)
        DUMP_DIR[0] = args.dump_ptx
    failed = []
    t0 = time.time()
    for label, fn, fn_args in cases(args.quick):
        if args.only and args.only not in label:
            continue
        CURRENT_CASE[0] = label
        try:
            fn(*fn_args)
        except Exception as e:  # report every failure, not just the first
            failed.append(f"{label}: {type(e).__name__}: {str(e)[:400]}")
    print(
        f"{'kernel':28} {'warps':>5} {'stages':>6} {'smem KB':>7} {'regs':>4} {'spill':>5} {'mma':>5} {'loads':>8}  "
        "first case"
    )
    for r in RESULTS:
        why = [w for w, b in (("SMEM", r["shared"] > MAX_SHARED), ("SPILLS", r["spills"] > MAX_SPILL),
                              ("WGMMA SERIALIZED", r["serial"])) if b]  # fmt: skip
        bad = bool(why)
        flag = "   <-- " + " ".join(why) if bad else ""
        print(
            f"{r['name'][:28]:28} {r['warps']:5d} {r['stages']:6d} {r['shared'] / 1024:7.1f} {r['regs']:4d} "
            f"{r['spills']:5d} {r['mma']:>5} {r['pipe']:>8}  {r['case']}{flag}"
        )
        if bad:
            failed.append(f"{r['name']} ({r['case']}): {', '.join(why)}; shared {r['shared']} B, spills {r['spills']}")
    print(f"{len(RESULTS)} kernels compiled for sm_90 in {time.time() - t0:.0f} s")
    if args.sigs:
        with open(args.sigs, "w") as f:
            json.dump(SIGS, f, indent=1, sort_keys=True)
    if args.against:
        with open(args.against) as f:
            old = json.load(f)
        diff = sorted(k for k in old.keys() | SIGS.keys() if old.get(k) != SIGS.get(k))
        print(f"PTX against {args.against}: {len(SIGS) - len(diff)} of {len(SIGS)} (case, kernel) pairs identical")
        failed += [f"PTX differs: {k}" for k in diff]
    for f in failed:
        print("FAIL", f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
