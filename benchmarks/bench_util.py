"""Shared pieces of kernels_bench.py: case sizes (real and --smoke), the result table/JSON, timing."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from dataclasses import dataclass, field

import torch

BW, FLOPS = 4.3e12, 790e12
BF = torch.bfloat16
TOL = 1e-2


@dataclass
class Sizes:
    dev: str = "cuda"
    R: int = 512
    P: int = 64
    mla_heads: tuple = (16, 64)
    mla_batches: tuple = (1, 16, 32)
    mla_ctx: tuple = (1024, 2048, 4096, 8192, 16384, 32768)
    mla_sweep: tuple = (16, 16, 8192)  # B, H, ctx
    mla_q32_heads: int = 16  # mla_q32: blocks of 32 tokens over these cached contexts, these requests
    mla_q32_ctx: tuple = (1024, 4096, 8192)
    mla_q32_B: tuple = (1, 2, 8)
    mla_verify_heads: tuple = (16, 64)  # mla_verify: blocks of 2 and 4 tokens (a verify's) over these contexts
    mla_verify_ctx: tuple = (512, 8192, 16384)
    mla_verify_B: tuple = (1, 8, 32)
    moe: dict = field(default_factory=lambda: {"moonlight": (2048, 1408, 64, 6), "kimi-tp4": (7168, 512, 384, 8)})
    moe_T: tuple = (1, 2, 4, 8, 16, 32, 64, 8192)
    moe_sweep_shapes: tuple = ("moonlight",)
    moe_sweep_decode_T: tuple = (1, 8, 32)
    moe_sweep_budget_s: float = 85.0
    moe_sweep_max_cfgs: int = 8  # per list (decode, gemm1, gemm2)
    prefill: tuple = ((512, 512), (8192, 8192), (2048, 8192))
    prefill_dims: tuple = (16, 192, 128)  # H, Dqk, Dv
    prefill_sweep: tuple = (16, 128, 64, 128, 8192, 8192)  # H, N, P, V, q, k: the M1 8k prefill, one layer
    routing: tuple = (("kimi", 384, 1, 1, 8), ("deepseek-v3", 256, 8, 4, 8), ("moonlight", 64, 1, 1, 6))
    routing_T: tuple = (1, 64, 8192)
    rope_T: tuple = (16, 8192)
    rope_H: tuple = (16, 128)
    # moe_layers: weights of this many layers in turn (more than L2 holds, as in the engine's layer loop)
    layers: int = 8
    layers_T: tuple = (1, 2, 4)
    # moe_shared: the MoE block with the shared experts fused into the Triton MoE vs not, over `layers` layers
    shared_preset: str = "moonlight-16b-a3b"
    shared_T: tuple = (1, 2, 4, 16, 64, 256)
    # moe_norm: the MoE sum with the add + norm after it fused in vs not (kernels, and the shared_preset block)
    norm_T: tuple = (1, 4, 32, 256)
    # moe_decode: the first moe shape with this many shared slots fused in, tiles swept at these T
    decode_shared: int = 2
    decode_T: tuple = (1, 4, 8, 32)
    # lin_decode: decode-sized dense projections [N, K] (M1's q|kv_a and o_proj)
    decode_linears: tuple = ((3648, 2048), (2048, 2048))
    decode_linear_T: tuple = (1, 2, 4, 8, 32)
    # bi_gemm: deterministic mode's dense GEMM against F.linear at M1's linears ([N, K]: q|kv_a, kv_a alone, o_proj,
    # the shared experts' gate|up and down, the dense MLP's gate|up, the lm_head), decode to prefill row counts
    bi_gemm_shapes: tuple = (
        (3648, 2048),
        (576, 2048),
        (2048, 2048),
        (2816, 2048),
        (2048, 1408),
        (22528, 2048),
        (163840, 2048),
    )
    bi_gemm_M: tuple = (1, 8, 32, 256, 8192)
    # gqa: the EAGLE3 draft's attention ([heads, kv heads, head_dim]: M1's draft, Kimi-K2.5's), contexts and batches
    gqa_heads: tuple = ((16, 16, 128), (64, 64, 128))
    gqa_ctx: tuple = (512, 8192, 16384)
    gqa_B: tuple = (1, 8)
    decode_max_cfgs: int = 16  # moe_decode tiles per GEMM, lin_decode GEMV tiles, absorb head_gemv tiles
    # absorb: the absorbed projections' bmm vs head_gemv (M1's 16 heads; Kimi-K2.5 at attention TP4 has 16 too)
    absorb_heads: int = 16
    absorb_T: tuple = (1, 2)
    launch_n: int = 200  # launch: kernels per timed graph


def smoke_sizes() -> Sizes:
    return Sizes(
        dev="cpu",
        R=32,
        P=8,
        mla_heads=(4,),
        mla_batches=(2,),
        mla_ctx=(40,),
        mla_sweep=(2, 4, 40),
        mla_q32_heads=4,
        mla_q32_ctx=(8,),
        mla_q32_B=(1,),
        mla_verify_heads=(4,),
        mla_verify_ctx=(8,),
        mla_verify_B=(1,),
        moe={"tiny": (64, 32, 8, 2)},
        moe_T=(1, 48),
        moe_sweep_shapes=("tiny",),
        moe_sweep_decode_T=(1, 8),
        moe_sweep_max_cfgs=2,
        prefill=((20, 20), (8, 30)),
        prefill_dims=(2, 24, 24),
        prefill_sweep=(2, 16, 8, 24, 40, 40),
        routing=(("tiny", 8, 2, 1, 2),),
        routing_T=(3,),
        rope_T=(5,),
        rope_H=(4,),
        layers=2,
        layers_T=(1,),
        shared_preset="tiny",
        shared_T=(1, 3),
        norm_T=(1, 5),
        decode_shared=1,
        decode_T=(1,),
        decode_linears=((24, 16),),
        decode_linear_T=(1,),
        bi_gemm_shapes=((24, 16),),
        bi_gemm_M=(1, 3, 256),
        gqa_heads=((4, 2, 16),),
        gqa_ctx=(40,),
        gqa_B=(2,),
        decode_max_cfgs=2,
        absorb_heads=2,
        absorb_T=(1,),
        launch_n=2,
    )


# prefill_attention_mla tile configs for the sweep (the default, prefill_config's bf16 one, runs first); shared
# memory for Dqk=192, Dv=128 bf16 is about BLOCK_M * 384 B + num_stages * BLOCK_N * 640 B (< 227 KB on sm_90).
PREFILL_SWEEP = [  # compile_check (sm_90): M128 N128 w8 s2 spills 40 B; M128 w4 and M64 N128 w4 spill more
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=4),
]
PREFILL_HEAD_GROUPS = (1, 2, 8, 16)  # on the default tiles (a runtime argument: no recompile)


class Report:
    def __init__(self, path: str, meta: dict):
        self.path, self.rows, self.meta = path, [], meta
        print(f"{'kernel':10} {'case':58} {'us':>9} {'TB/s':>6} {'%bw':>5} {'TFLOP/s':>8} {'%pk':>5} {'relerr':>8}")

    def add(self, kernel: str, case: str, ms: float, nbytes: float = 0.0, flops: float = 0.0, err=None, **extra):
        row = dict(kernel=kernel, case=case, us=ms * 1e3, bytes=nbytes, flops=flops, rel_err=err, **extra)
        row["tbps"] = nbytes / (ms * 1e-3) / 1e12 if nbytes else None
        row["tflops"] = flops / (ms * 1e-3) / 1e12 if flops else None
        self.rows.append(row)
        bw = f"{row['tbps']:6.2f} {100 * row['tbps'] * 1e12 / BW:4.0f}%" if nbytes else f"{'':6} {'':5}"
        fl = f"{row['tflops']:8.1f} {100 * row['tflops'] * 1e12 / FLOPS:4.0f}%" if flops else f"{'':8} {'':5}"
        e = "" if err is None else f"{err:8.1e}" + (" FAIL" if err >= TOL else "")
        print(f"{kernel:10} {case:58} {ms * 1e3:9.1f} {bw} {fl} {e}", flush=True)  # a longer case shifts its row

    def save(self, **status):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(dict(meta=self.meta, status=status, rows=self.rows), f, indent=1)


def code_id() -> dict:
    """git HEAD (as the tree that runs sees it: a copied tree's git metadata can be stale) and a hash of
    mlaserve/**/*.py, which identifies the code measured whatever git says (`git stash`/checkout, then recompute);
    in a tree ab_trees.sh exported, also its AB_SOURCE line (the ref and commit it was made from, its switches)."""
    import hashlib
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    h = hashlib.sha1()
    for f in sorted((root / "mlaserve").rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=root
            ).stdout.strip()
            or None
        )
    except Exception:
        commit = None
    out = dict(commit=commit, source_sha1=h.hexdigest()[:12])
    if (root / "AB_SOURCE").is_file():
        out["ab_source"] = (root / "AB_SOURCE").read_text().strip()
    return out


def meta(sz: Sizes) -> dict:
    import triton

    gpu = torch.cuda.get_device_name() if sz.dev == "cuda" else "cpu (smoke, interpreter)"
    return dict(
        **code_id(),
        gpu=gpu,
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        ceilings=dict(bw=BW, flops=FLOPS),
        sizes={k: str(v) for k, v in sz.__dict__.items()},
    )


def bench(fn, sz: Sizes) -> float:
    """Median milliseconds."""
    if sz.dev != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench, do_bench_cudagraph

    try:  # replays of a captured graph: the kernels' own time, without Python launch overhead
        return do_bench_cudagraph(fn, rep=30, return_mode="median")
    except Exception:  # not capturable (host syncs, e.g. the SDPA loop)
        return do_bench(fn, warmup=5, rep=30, return_mode="median")


def sleep_cycles(ms: float) -> int:
    """Clock cycles for torch.cuda._sleep to hold the GPU about `ms` (the sleep kernel counts cycles): one timed
    sleep of 10M cycles scales it."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    return int(ms * 1e7 / a.elapsed_time(b))


def back_to_back_ms(fn, reps: int = 60, warm: int = 5) -> float:
    """ms a call of fn (a graph's replay, say) called back to back, after `warm` calls, one sync at each end: the GPU's
    time a call wherever the host keeps ahead of it."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def graph_us(fn, items, replays: int = 5) -> float:
    """Microseconds a call: fn(item) for every item of `items` captured in one CUDA graph (after three eager calls),
    the median of `replays` replays divided by the item count. Items that rotate over more than L2 holds (weights,
    buffers, routings) keep each call's reads in HBM."""
    items = list(items)
    for it in items[:3]:
        fn(it)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for it in items:
            fn(it)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        g.replay()
        en.record()
        torch.cuda.synchronize()
        ts.append(st.elapsed_time(en) / len(items) * 1000)
    return sorted(ts)[len(ts) // 2]


def save_json(name: str, rows: list) -> str:
    """$OUT/<name> (default out/): {"gpu": the device's name, "rows": rows}; returns the path."""
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return path


def cfg_label(cfg: dict) -> str:
    """ "BLOCK_N": 32, "num_warps": 4, "PARTIAL_DTYPE": torch.bfloat16 -> "N32 w4 PARTIAL_DTYPEbfloat16"."""
    short = {"BLOCK_M": "M", "BLOCK_N": "N", "BLOCK_K": "K", "num_warps": "w", "num_stages": "s"}
    return " ".join(f"{short.get(k, k)}{str(v).replace('torch.', '')}" for k, v in cfg.items())


def rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def moe_inputs(T, D, E, K, dev):
    """x [T, D] bf16, ids [T, K] (K distinct experts per token), weights [T, K] fp32."""
    x = torch.randn(T, D, device=dev).to(BF)
    ids = torch.rand(T, E, device=dev).topk(K, -1).indices
    return x, ids, torch.rand(T, K, device=dev)
