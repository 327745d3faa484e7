"""Check and time every Triton kernel on the GPU: correctness against the fp32 torch reference on fresh inputs,
then triton.testing.do_bench (median, cold L2). Prints a table against the H200 ceilings (4.3 TB/s copy bandwidth,
790 TFLOP/s bf16) and writes everything to $OUT/kernels_bench.json (OUT defaults to ./out).

    PYTHONPATH=$PWD python benchmarks/kernels_bench.py [--quick] [--only mla,moe,...] [--time-limit 290]

Sections run in order mla, moe, prefill, routing, rope, then the sweeps (SWEEPS: the decode-step sweeps of
decode_sweeps.py, the MoE sweeps of moe_sweeps.py, mla_sweep, mla_q32, mla_verify, moe_sweep, prefill_sweep) and
the quantized sections (int4_moe: benchmarks/int4_moe_bench.py; fp8_linear, fp8_moe: benchmarks/fp8_bench.py),
which --quick skips; `--only prefill_sweep` times the 8k prefill attention alone (under a minute). With
--time-limit a watchdog ends the run after that many seconds (exit 3), keeping what it has in the JSON.
--smoke runs every code path at toy sizes on the CPU (TRITON_INTERPRET=1 is set for it): a check of the script.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from benchmarks.bench_util import (  # noqa: E402
    BF,
    PREFILL_HEAD_GROUPS,
    PREFILL_SWEEP,
    TOL,
    Report,
    Sizes,
    bench,
    cfg_label,
    meta,
    moe_inputs,
    rel,
    smoke_sizes,
)
from benchmarks.decode_sweeps import (  # noqa: E402
    run_absorb,
    run_bi_gemm,
    run_gqa,
    run_launch,
    run_linear_decode,
    run_moe_decode,
)
from benchmarks.fp8_bench import run_fp8_linear, run_fp8_moe  # noqa: E402
from benchmarks.int4_moe_bench import run_int4_moe  # noqa: E402
from benchmarks.moe_sweeps import run_moe_layers, run_moe_norm, run_moe_shared, run_moe_sweep  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------
def run_mla(rep: Report, sz: Sizes):
    from mlaserve.kernels.mla_decode import default_num_splits, mla_decode
    from tests.helpers.kernel_checks import make_paged
    from tests.helpers.kernel_refs import mla_decode_ref

    R, P, scale = sz.R, sz.P, 192**-0.5
    for H in sz.mla_heads:
        for q_len in (1, 2):
            for B in sz.mla_batches:
                for L in sz.mla_ctx:
                    kv, table, lens = make_paged([L] * B, 64, R + P, BF, sz.dev, extra_pages=0)
                    q = torch.randn(B * q_len, H, R + P, device=sz.dev).to(BF)
                    out = torch.empty(B * q_len, H, R, device=sz.dev, dtype=BF)
                    mla_decode(q, kv, table, lens, q_len, scale, out)
                    err = rel(out, mla_decode_ref(q, kv, table, lens, q_len, scale, R))
                    ms = bench(lambda: mla_decode(q, kv, table, lens, q_len, scale, out), sz)  # noqa: B023
                    nbytes = B * L * (R + P) * 2 + q.numel() * 2 + out.numel() * 2
                    S = default_num_splits(B, H, q_len, q.device)
                    rep.add(
                        "mla_decode",
                        f"H={H} q_len={q_len} B={B} ctx={L} splits={S}",
                        ms,
                        nbytes,
                        err=err,
                        H=H,
                        q_len=q_len,
                        B=B,
                        ctx=L,
                        splits=S,
                    )
    if sz.dev == "cuda":
        torch.cuda.empty_cache()


def run_mla_sweep(rep: Report, sz: Sizes):
    """The target case (8k context, B=16, H=16, q_len=1) across tile configs and split counts."""
    from mlaserve.kernels.mla_decode import mla_decode
    from tests.helpers.kernel_checks import make_paged

    (B, H, L), R, P = sz.mla_sweep, sz.R, sz.P
    kv, table, lens = make_paged([L] * B, 64, R + P, BF, sz.dev, extra_pages=0)
    q = torch.randn(B, H, R + P, device=sz.dev).to(BF)
    out = torch.empty(B, H, R, device=sz.dev, dtype=BF)
    from tests.helpers.kernel_refs import mla_decode_ref

    ref = mla_decode_ref(q, kv, table, lens, 1, 0.1, R)
    variants = [
        dict(TMA=False),
        dict(TMA=False, PARTIAL_DTYPE=BF),
        dict(TMA=True),
        dict(TMA=True, PARTIAL_DTYPE=BF),
        dict(TMA=True, num_stages=4),
        dict(TMA=True, num_warps=8),
    ]
    for cfg in variants:
        for S in (8, 16):
            try:
                ms = bench(lambda: mla_decode(q, kv, table, lens, 1, 0.1, out, num_splits=S, config=cfg), sz)  # noqa: B023
                rep.add(
                    "mla_sweep",
                    f"B={B} H={H} ctx={L} {cfg_label(cfg)} splits={S}",
                    ms,
                    B * L * (R + P) * 2,
                    err=rel(out, ref),
                    config={k: str(v) for k, v in cfg.items()},
                    splits=S,
                )
            except Exception as e:  # e.g. out of shared memory
                print(f"mla_sweep {cfg} splits={S}: {type(e).__name__}: {str(e)[:120]}")
    # Batch 1 (latency bound): the batch 1-3 tiles (mla_decode.FEW_PROGRAMS: 2 stages) against the former 3
    # stages, 16-token tiles and splits, coarser splits, and (at 512) warps and partials.
    b1 = [
        {},
        dict(num_stages=3),
        dict(BLOCK_N=16, MIN_SPLIT_TOKENS=16),
        dict(MIN_SPLIT_TOKENS=64),
        dict(MIN_SPLIT_TOKENS=256),
    ]
    b1_512 = [dict(num_warps=8), dict(num_stages=1), dict(PARTIAL_DTYPE=BF), dict(TMA=True)]
    for L1 in (512, 8192) if sz.dev == "cuda" else sz.mla_ctx[:1]:
        kv, table, lens = make_paged([L1], 64, R + P, BF, sz.dev, extra_pages=0)
        q1 = torch.randn(1, H, R + P, device=sz.dev).to(BF)
        o1 = torch.empty(1, H, R, device=sz.dev, dtype=BF)
        ref1 = mla_decode_ref(q1, kv, table, lens, 1, 0.1, R)
        for cfg in b1 + (b1_512 if L1 <= 512 else []):
            ms = bench(lambda: mla_decode(q1, kv, table, lens, 1, 0.1, o1, config=cfg), sz)  # noqa: B023
            rep.add(
                "mla_sweep",
                f"B=1 H={H} ctx={L1} {cfg_label(cfg)}",
                ms,
                L1 * (R + P) * 2,
                err=rel(o1, ref1),
                config={k: str(v) for k, v in cfg.items()},
            )


def _time_mla_blocks(rep: Report, sz: Sizes, section: str, label: str, B: int, H: int, ql: int, L: int, variants):
    """mla_decode over B requests of L cached tokens plus a block of ql new ones each, H heads: each variant (name,
    config overrides or None, splits or None for the default) checked against the fp32 reference and timed."""
    from mlaserve.kernels.mla_decode import default_num_splits, mla_decode
    from tests.helpers.kernel_checks import make_paged
    from tests.helpers.kernel_refs import mla_decode_ref

    R, P = sz.R, sz.P
    kv, table, lens = make_paged([L + ql] * B, 64, R + P, BF, sz.dev, extra_pages=0)
    q = torch.randn(B * ql, H, R + P, device=sz.dev).to(BF)
    out = torch.empty(B * ql, H, R, device=sz.dev, dtype=BF)
    ref = mla_decode_ref(q, kv, table, lens, ql, 0.1, R)
    for name, cfg, S in variants:
        try:
            run = lambda: mla_decode(q, kv, table, lens, ql, 0.1, out, num_splits=S, config=cfg)  # noqa: E731,B023
            out.fill_(float("nan"))
            run()
            ms = bench(run, sz)
            splits = S or default_num_splits(B, H, ql, q.device)
            rep.add(
                section,
                f"{label} {name} splits={splits}",
                ms,
                B * (L + ql) * (R + P) * 2,
                err=rel(out, ref),
                H=H,
                q_len=ql,
                B=B,
                ctx=L,
                splits=splits,
                tflops=2 * B * ql * H * (L + ql) * (2 * R + P) / (ms * 1e9),
            )
        except Exception as e:  # e.g. out of registers or shared memory
            print(f"{section} {name}: {type(e).__name__}: {str(e)[:120]}")


def run_mla_q32(rep: Report, sz: Sizes):
    """Blocks of 32 tokens (a short suffix's rows, engine/suffix.py) at M1's 16 heads: the default tiles (two heads
    a program, M=64, one wave of programs) against one head a program (M=32) in one or two waves, and neighbours."""
    from mlaserve.kernels.mla_decode import MAX_Q_LEN, num_sms

    H, ql = sz.mla_q32_heads, MAX_Q_LEN
    for B in sz.mla_q32_B:
        sms = num_sms(torch.device(sz.dev))
        one_head = B * H  # programs of one head each
        variants = [
            ("default", None, None),
            ("1 head, 2 waves", dict(BLOCK_H=1), max(1, 2 * sms // one_head)),
            ("1 head, 1 wave", dict(BLOCK_H=1), max(1, sms // one_head)),
            ("1 head, 4 warps", dict(BLOCK_H=1, num_warps=4), max(1, 2 * sms // one_head)),
            ("2 heads, 2 waves", dict(BLOCK_H=2), max(1, 4 * sms // one_head)),
        ]
        if sz.dev != "cuda":  # --smoke: the interpreter is slow
            variants = variants[:2]
        for L in sz.mla_q32_ctx:
            _time_mla_blocks(rep, sz, "mla_q32", f"B={B} H={H} ctx={L}+{ql}", B, H, ql, L, variants)


def run_mla_verify(rep: Report, sz: Sizes):
    """Verify blocks (2 and 4 tokens a request) at M1's 16 heads and Kimi-K2.5's 64: the default tiles (16 rows a
    program in 4 warps) against the 32 rows in 8 warps they had before and 32 rows in 4 warps (both at the default's
    split count, which is planned for 16-row programs: half of what 32-row tiles had), half or twice the default
    splits, and splits of at least 64 tokens (mla_decode.MIN_SPLIT_TOKENS: 32), which halves them at short
    contexts only."""
    from mlaserve.kernels.mla_decode import default_num_splits

    for H in sz.mla_verify_heads:
        for ql in (2, 4):
            m32 = dict(BLOCK_H=max(1, 32 // ql))
            for B in sz.mla_verify_B:
                S0 = default_num_splits(B, H, ql, torch.device(sz.dev))
                variants = [
                    ("default", None, None),
                    ("32 rows, 8 warps", dict(m32, num_warps=8), None),
                    ("32 rows, 4 warps", dict(m32, num_warps=4), None),
                    ("splits / 2", None, max(1, S0 // 2)),
                    ("splits x 2", None, 2 * S0),
                    ("splits >= 64 tokens", dict(MIN_SPLIT_TOKENS=64), None),  # fewer splits at short contexts only
                ]
                if sz.dev != "cuda":  # --smoke: the interpreter is slow
                    variants = variants[:2]
                for L in sz.mla_verify_ctx:
                    label = f"H={H} q_len={ql} B={B} ctx={L}+{ql}"
                    _time_mla_blocks(rep, sz, "mla_verify", label, B, H, ql, L, variants)
        if sz.dev == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
def run_moe(rep: Report, sz: Sizes):
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref

    for name, (D, I, E, K) in sz.moe.items():
        w13 = (torch.randn(E, 2 * I, D, device=sz.dev) / D**0.5).to(BF)
        w2 = (torch.randn(E, D, I, device=sz.dev) / I**0.5).to(BF)
        w13f, w2f = w13.float(), w2.float()
        for T in sz.moe_T:
            x, ids, w = moe_inputs(T, D, E, K, sz.dev)
            err = rel(fused_experts(x, w13, w2, w, ids, 0), fused_experts_ref(x.float(), w13f, w2f, w, ids, 0))
            ms = bench(lambda: fused_experts(x, w13, w2, w, ids, 0), sz)  # noqa: B023
            n_exp = int(ids.unique().numel())
            nbytes, flops = n_exp * 3 * D * I * 2 + 2 * x.numel() * 2, 6.0 * T * K * D * I
            decode = T <= 64  # memory bound: bytes of the selected experts; else FLOPs
            rep.add(
                "fused_moe",
                f"{name} T={T} experts={n_exp}",
                ms,
                nbytes if decode else 0.0,
                0.0 if decode else flops,
                err=err,
                shape=name,
                T=T,
                experts=n_exp,
                flops_all=flops,
                bytes_all=nbytes,
            )
        from mlaserve.kernels.moe_align import moe_align
        from mlaserve.kernels.moe_config import moe_config

        for T in sz.moe_T:  # the align alone (T*K <= 16 pairs skip it inside fused_experts)
            _, ids, _ = moe_inputs(T, D, E, K, sz.dev)
            bm = moe_config(T, K, E, D, I, BF)[0]["BLOCK_M"]
            ms = bench(lambda: moe_align(ids, E, 0, bm), sz)  # noqa: B023
            rep.add("moe_align", f"{name} T={T} pairs={T * K} BLOCK_M={bm}", ms, T=T, shape=name)
            # with S = 2 fused shared slots after the routed ones (M1's layer): counted as experts, or placed
            ids_s = torch.cat([ids, torch.arange(E, E + 2, device=ids.device).expand(T, 2)], 1)
            bm = moe_config(T, K + 2, E + 2, D, I, BF)[0]["BLOCK_M"]
            for how, S in (("counted", 0), ("placed", 2)):
                ms = bench(lambda: moe_align(ids_s, E + 2, 0, bm, shared=S), sz)  # noqa: B023
                rep.add("moe_align", f"{name} T={T} +2 shared {how} BLOCK_M={bm}", ms, T=T, shape=name)
        w13 = w2 = w13f = w2f = None  # free before the next shape
        if sz.dev == "cuda":
            torch.cuda.empty_cache()


# decode (BLOCK_M 16: weight streaming): flat configs, both GEMMs; prefill: each GEMM alone, the other at its default
# ---------------------------------------------------------------------------------------------------------------
def run_prefill(rep: Report, sz: Sizes):
    from mlaserve.kernels.prefill_attention import prefill_attention, prefill_attention_sdpa
    from tests.helpers.kernel_refs import prefill_attention_ref

    H, Dqk, Dv = sz.prefill_dims
    for qn, kn in sz.prefill:
        q = torch.randn(qn, H, Dqk, device=sz.dev).to(BF)
        k = torch.randn(kn, H, Dqk, device=sz.dev).to(BF)
        v = torch.randn(kn, H, Dqk, device=sz.dev).to(BF)[..., :Dv]  # strided, as in the model
        cu_q = torch.tensor([0, qn], dtype=torch.int32, device=sz.dev)
        cu_k = torch.tensor([0, kn], dtype=torch.int32, device=sz.dev)
        out = torch.empty(qn, H, Dv, device=sz.dev, dtype=BF)
        ref = prefill_attention_ref(q, k, v, cu_q, cu_k, Dqk**-0.5)
        flops = 2.0 * H * (Dqk + Dv) * (qn * (kn - qn) + qn * (qn + 1) / 2)  # visible (query, key) pairs
        for impl, fn in (("triton", prefill_attention), ("sdpa", prefill_attention_sdpa)):
            out.fill_(float("nan"))
            fn(q, k, v, cu_q, cu_k, Dqk**-0.5, out, qn)
            err = rel(out, ref)
            ms = bench(lambda: fn(q, k, v, cu_q, cu_k, Dqk**-0.5, out, qn), sz)  # noqa: B023
            rep.add("prefill", f"{impl} q={qn} k={kn} H={H}", ms, 0.0, flops, err=err, impl=impl, q=qn, k=kn)
        ref = None
        if sz.dev == "cuda":
            torch.cuda.empty_cache()


def _mla_prefill_inputs(sz: Sizes):
    """The model's prefill operands at (H, N, P, V, q, k): q, k_nope and v views of one projection, k_rope of
    the latent (R=512 wide), cu_q, cu_k, out, and the concatenated k of the old form."""
    H, N, P, V, qn, kn = sz.prefill_sweep
    q = torch.randn(qn, H, N + P, device=sz.dev).to(BF)
    kv = torch.randn(kn, H, N + V, device=sz.dev).to(BF)
    latent = torch.randn(kn, sz.R + P, device=sz.dev).to(BF)
    k_nope, k_rope, v = kv[..., :N], latent[:, sz.R :], kv[..., N:]
    cu_q = torch.tensor([0, qn], dtype=torch.int32, device=sz.dev)
    cu_k = torch.tensor([0, kn], dtype=torch.int32, device=sz.dev)
    out = torch.empty(qn, H, V, device=sz.dev, dtype=BF)
    return q, k_nope, k_rope, v, cu_q, cu_k, out


def run_prefill_sweep(rep: Report, sz: Sizes):
    """The M1 8k prefill attention (one layer) through prefill_attention_mla across tile configs and head groups,
    the old form (torch.cat of K, then the kernel), and torch SDPA per backend. rel_err: the default config's
    against the fp32 reference, every other row's against the default config's output."""
    from mlaserve.kernels.prefill_attention import prefill_attention, prefill_attention_mla
    from tests.helpers.kernel_refs import prefill_attention_ref

    H, N, P, V, qn, kn = sz.prefill_sweep
    q, k_nope, k_rope, v, cu_q, cu_k, out = _mla_prefill_inputs(sz)
    scale = (N + P) ** -0.5
    flops = 2.0 * H * (N + P + V) * (qn * (kn - qn) + qn * (qn + 1) / 2)
    base = prefill_attention_mla(q, k_nope, k_rope, v, cu_q, cu_k, scale, torch.empty_like(out), qn).clone()
    k_full = torch.cat([k_nope, k_rope[:, None].expand(kn, H, P)], -1)
    base_err = rel(base, prefill_attention_ref(q, k_full, v, cu_q, cu_k, scale))
    k_full = None
    variants = [None] + [dict(HEAD_GROUP=g) for g in PREFILL_HEAD_GROUPS] + PREFILL_SWEEP
    for cfg in variants:
        try:
            out.fill_(float("nan"))
            prefill_attention_mla(q, k_nope, k_rope, v, cu_q, cu_k, scale, out, qn, config=cfg)
            err = rel(out, base) if cfg else base_err
            ms = bench(
                lambda c=cfg: prefill_attention_mla(q, k_nope, k_rope, v, cu_q, cu_k, scale, out, qn, config=c), sz
            )
            rep.add(
                "pf_sweep",
                f"mla q={qn} k={kn} H={H} {cfg_label(cfg) if cfg else 'default'}",
                ms,
                0.0,
                flops,
                err=err,
                config=cfg,
            )
        except Exception as e:  # e.g. out of shared memory
            print(f"prefill_sweep {cfg}: {type(e).__name__}: {str(e)[:160]}")

    def old_form():  # what the model did before: K = [k_nope | k_rope expanded over heads], then the kernel
        k = torch.cat([k_nope, k_rope[:, None].expand(kn, H, P)], -1)
        return prefill_attention(q, k, v, cu_q, cu_k, scale, out, qn)

    out.fill_(float("nan"))
    old_form()
    rep.add("pf_sweep", f"old form: cat K + kernel q={qn} k={kn}", bench(old_form, sz), 0.0, flops, err=rel(out, base))
    _sdpa_backends(rep, sz, q, k_nope, k_rope, v, scale, base, flops)
    if sz.dev == "cuda":
        torch.cuda.empty_cache()


def _sdpa_backends(rep, sz, q, k_nope, k_rope, v, scale, base, flops):
    """One causal q=k SDPA call per backend (qk dim N+P, v dim V): not every backend accepts unequal dims."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kn, H, P = k_nope.shape[0], k_nope.shape[1], k_rope.shape[-1]
    k = torch.cat([k_nope, k_rope[:, None].expand(kn, H, P)], -1)
    qb, kb, vb = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, T, D]
    names = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"] + (["MATH"] if sz.dev != "cuda" else [])
    for name in names:
        backend = getattr(SDPBackend, name)

        def call():
            with sdpa_kernel(backend):  # noqa: B023
                return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)

        try:
            o = call()
            err = rel(o[0].transpose(0, 1), base)
            rep.add(
                "pf_sweep",
                f"torch sdpa {name.lower()} q={q.shape[0]} k={kn} (K cat before)",
                bench(call, sz),
                0.0,
                flops,
                err=err,
                sdpa=name,
            )
        except Exception as e:
            print(f"prefill_sweep sdpa {name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def run_routing(rep: Report, sz: Sizes):
    from mlaserve.kernels.routing import route_noaux_tc_logits
    from mlaserve.layers.moe import route_noaux_tc

    for name, E, G, TG, K in sz.routing:
        for T in sz.routing_T:
            logits, bias = torch.randn(T, E, device=sz.dev), 0.1 * torch.randn(E, device=sz.dev)
            args = (logits, bias, K, G, TG, True, 2.5)
            ms = bench(lambda: route_noaux_tc_logits(*args), sz)  # noqa: B023
            ms_ref = bench(lambda: route_noaux_tc(*args), sz)  # noqa: B023
            w, ids = route_noaux_tc_logits(*args)
            rw, rids = route_noaux_tc(*args)
            same = (ids.sort(-1).values == rids.sort(-1).values).all(-1).float().mean().item()
            rep.add(
                "routing",
                f"{name} E={E} G={G} T={T} same ids {same:.4f} (torch {ms_ref * 1e3:.0f} us)",
                ms,
                torch_us=ms_ref * 1e3,
                same_ids_frac=same,
            )


def run_rope(rep: Report, sz: Sizes):
    from mlaserve.kernels.rope_kv import rope_q, rope_store_kv
    from mlaserve.layers.rotary import apply_rope
    from tests.helpers.kernel_refs import rope_store_kv_ref

    R, P, dev = sz.R, sz.P, sz.dev
    for T in sz.rope_T:
        cache = torch.zeros(T // 16 + 8, 64, R + P, device=dev, dtype=BF)
        slots = torch.randperm(cache.shape[0] * 64, device=dev)[:T]
        kv_a = torch.randn(T, R + P, device=dev).to(BF)
        c_kv, k_pe = kv_a[:, :R].contiguous(), kv_a[:, R:]
        cos, sin = torch.rand(T, P // 2, device=dev), torch.rand(T, P // 2, device=dev)
        ref = rope_store_kv_ref(cache, slots, c_kv, k_pe, cos, sin)
        rope_store_kv(cache, slots, c_kv, k_pe, cos, sin)
        err = rel(cache, ref)
        ms = bench(lambda: rope_store_kv(cache, slots, c_kv, k_pe, cos, sin), sz)  # noqa: B023
        rep.add("rope_kv", f"rope_store_kv T={T}", ms, T * (R + P) * 2 * 2, err=err)
        for H in sz.rope_H:
            x = torch.randn(T, H, R + P, device=dev).to(BF)[..., R:]  # Q[..., R:]
            ref = apply_rope(x, cos, sin, torch.empty(x.shape, device=dev))
            rope_q(x, cos, sin, x)
            err = rel(x, ref)
            ms = bench(lambda: rope_q(x, cos, sin, x), sz)  # noqa: B023
            ms_t = bench(lambda: apply_rope(x, cos, sin, x), sz)  # noqa: B023
            rep.add(
                "rope_kv",
                f"rope_q T={T} H={H} (torch apply_rope {ms_t * 1e3:.0f} us)",
                ms,
                T * H * P * 2 * 2,
                err=err,
                torch_us=ms_t * 1e3,
            )


SECTIONS = {
    "mla": run_mla,
    "moe": run_moe,
    "prefill": run_prefill,
    "routing": run_routing,
    "rope": run_rope,
    "moe_layers": run_moe_layers,
    "moe_shared": run_moe_shared,
    "moe_norm": run_moe_norm,
    "moe_decode": run_moe_decode,
    "lin_decode": run_linear_decode,
    "bi_gemm": run_bi_gemm,
    "gqa": run_gqa,
    "absorb": run_absorb,
    "launch": run_launch,
    "int4_moe": run_int4_moe,
    "fp8_linear": run_fp8_linear,
    "fp8_moe": run_fp8_moe,
    "mla_sweep": run_mla_sweep,
    "mla_q32": run_mla_q32,
    "mla_verify": run_mla_verify,
    "moe_sweep": run_moe_sweep,
    "prefill_sweep": run_prefill_sweep,
}  # sweeps last
SWEEPS = (
    "int4_moe",
    "moe_layers",
    "moe_shared",
    "moe_norm",
    "moe_decode",
    "lin_decode",
    "bi_gemm",
    "gqa",
    "absorb",
    "fp8_linear",
    "fp8_moe",
    "mla_sweep",
    "mla_q32",
    "mla_verify",
    "moe_sweep",
    "prefill_sweep",
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases, no config sweeps")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU under the Triton interpreter")
    ap.add_argument("--only", default=None, help=f"comma-separated sections of {','.join(SECTIONS)}")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds before a watchdog ends the run")
    args = ap.parse_args(argv)
    if args.smoke:
        from tests.kernels_interp.conftest import _patch_interpreter

        _patch_interpreter()
        sz = smoke_sizes()
    elif not torch.cuda.is_available():
        sys.exit("kernels_bench needs a CUDA GPU (or --smoke)")
    else:
        sz = Sizes()
        if args.quick:
            sz.mla_ctx, sz.moe_T = (1024, 8192, 32768), (1, 16, 64, 8192)
    rep = Report(os.path.join(os.environ.get("OUT", "./out"), "kernels_bench.json"), meta(sz))
    t0 = time.time()

    def watchdog():
        rep.save(finished=False, timed_out=True, seconds=time.time() - t0)
        print(f"watchdog: {args.time_limit:.0f} s passed; partial results in {rep.path}", flush=True)
        os._exit(3)

    timer = threading.Timer(args.time_limit, watchdog) if args.time_limit else None
    if timer:
        timer.daemon = True
        timer.start()
    torch.manual_seed(0)
    failed = []
    names = args.only.split(",") if args.only else [n for n in SECTIONS if not (args.quick and n in SWEEPS)]
    for name in names:
        try:
            SECTIONS[name](rep, sz)
        except Exception:
            traceback.print_exc()
            failed.append(name)
        rep.save(finished=False, sections_failed=failed, seconds=time.time() - t0)
    if timer:
        timer.cancel()
    bad = [r for r in rep.rows if r["rel_err"] is not None and r["rel_err"] >= TOL]
    rep.save(finished=True, sections_failed=failed, accuracy_failures=len(bad), seconds=time.time() - t0)
    print(
        f"done in {time.time() - t0:.0f} s; {len(bad)} accuracy failures; sections failed: {failed or 'none'}; "
        f"JSON: {rep.path}"
    )
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
