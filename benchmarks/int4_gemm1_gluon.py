"""The INT4 MoE's GEMM1 at small rows an expert: the Gluon kernel (int4_gemm_gluon.py: dequantized weights straight
into wgmma's register operand) against the Triton kernel it would replace (int4_gemm.py), one GPU.

Kimi-K2.5's experts (384 x [4096, 7168] packed, 5.6 GB: every call reads them from HBM), T tokens with 8 random
experts each over moe_align's 32-row blocks. Checks first, on poisoned outputs: both kernels against a torch
reference on sampled rows, and against each other on every row. Then each kernel's time in a CUDA graph of 5 calls,
rounds alternating, and the K permutation of x (permute_k) alone.

    PYTHONPATH=$PWD python benchmarks/int4_gemm1_gluon.py   # INT4_G1_T=128,512,1024,2048 INT4_G1_I=2048 (TP4: 512)
"""

from __future__ import annotations

import os

import torch

from benchmarks.bench_util import graph_us, save_json
from mlaserve.kernels.int4_gemm import bf16_pairs, int4_gemm1
from mlaserve.kernels.int4_gemm_gluon import int4_gemm1_gluon, permute_k
from mlaserve.kernels.int4_moe import gemm_config
from mlaserve.kernels.moe_align import moe_align
from mlaserve.kernels.pdl import pdl_args

E, D, K = 384, 7168, 8


def dequant_rows(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Packed rows w [R, D/8] int32 and scales s [R, D/32] -> [R, D] fp32 of bf16-rounded (n - 8) * scale."""
    n = (w[:, :, None] >> (4 * torch.arange(8, device=w.device))) & 15  # [R, D/8, 8]: nibble i of word c
    q = (n - 8).reshape(w.shape[0], -1).to(torch.bfloat16)
    return (q * s.repeat_interleave(32, dim=1)).float()


def main() -> None:
    I = int(os.environ.get("INT4_G1_I", 2048))
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randint(-(2**31), 2**31 - 1, (E, 2 * I, D // 8), dtype=torch.int32, device=dev, generator=g)
    s13 = (torch.rand(E, 2 * I, D // 32, device=dev, generator=g) * 0.02 + 0.005).to(torch.bfloat16)
    rows = []
    for T in [int(t) for t in os.environ.get("INT4_G1_T", "128,512,1024,2048").split(",")]:
        x = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices.to(torch.int32)
        c1, _ = gemm_config(T, K, E, D, I, x.dtype)
        c1 = {k: v for k, v in c1.items() if k != "TAIL"}
        sorted_ids, expert_ids, num_padded = moe_align(ids, E, 0, c1["BLOCK_M"])[:3]
        P = sorted_ids.shape[0]
        pdl = pdl_args(x, False)
        bf2 = bf16_pairs(x, s13)
        h_old = torch.full((P, I), float("nan"), dtype=x.dtype, device=dev)
        h_new = torch.full((P, I), float("nan"), dtype=x.dtype, device=dev)
        xp = permute_k(x)
        int4_gemm1(x, w13, s13, K, sorted_ids, expert_ids, num_padded, h_old, pdl, c1, bf2)
        int4_gemm1_gluon(xp, w13, s13, h_new, sorted_ids, expert_ids, num_padded, K, c1["BLOCK_M"])
        torch.cuda.synchronize()
        npad = int(num_padded.item())
        sid = sorted_ids[:npad].long()
        real = sid < T * K
        written = h_new[:npad]
        assert not written.isnan().any(), "the Gluon GEMM1 left rows below num_padded unwritten"
        assert (written[~real] == 0).all(), "padding rows must be zeros"
        diff = (h_new[:npad][real].float() - h_old[:npad][real].float()).abs().max().item()
        scale = h_old[:npad][real].float().abs().max().item()
        # torch reference on 6 real rows, all I columns
        pick = torch.nonzero(real).flatten()[torch.linspace(0, int(real.sum()) - 1, 6).long()]
        err_old = err_new = 0.0
        for m in pick.tolist():
            tok, e = int(sid[m]) // K, int(expert_ids[m // c1["BLOCK_M"]])
            wdq = dequant_rows(w13[e], s13[e])  # [2I, D]
            gu = x[tok].float() @ wdq.t()
            ref = torch.nn.functional.silu(gu[:I]) * gu[I:]
            den = ref.abs().max().item()
            err_old = max(err_old, (h_old[m].float() - ref).abs().max().item() / den)
            err_new = max(err_new, (h_new[m].float() - ref).abs().max().item() / den)
        lists = (sorted_ids, expert_ids, num_padded)

        def old(_i):
            int4_gemm1(x, w13, s13, K, *lists, h_old, pdl, c1, bf2)

        def new(_i):
            int4_gemm1_gluon(xp, w13, s13, h_new, *lists, K, c1["BLOCK_M"])

        def new_nopf(_i):
            int4_gemm1_gluon(xp, w13, s13, h_new, *lists, K, c1["BLOCK_M"], prefetch=False)

        lists16 = moe_align(ids, E, 0, 16)[:3]
        h16 = torch.empty(lists16[0].shape[0], I, dtype=x.dtype, device=dev)

        def new16(_i):
            int4_gemm1_gluon(xp, w13, s13, h16, *lists16, K, 16)

        us_old, us_new, us_nopf, us_16, us_perm = [], [], [], [], []
        for _ in range(2):
            us_old.append(graph_us(old, range(5)))
            us_new.append(graph_us(new, range(5)))
            us_nopf.append(graph_us(new_nopf, range(5)))
            us_16.append(graph_us(new16, range(5)))
            us_perm.append(graph_us(lambda _i: permute_k(x), range(5)))
        nexp = int(torch.unique(ids).numel())
        nbytes = nexp * 2 * I * (D // 2 + D // 32 * 2)
        r = dict(
            T=T,
            I=I,
            tiles=c1,
            experts_read=nexp,
            bytes=nbytes,
            triton_us=[round(u, 1) for u in us_old],
            gluon_us=[round(u, 1) for u in us_new],
            gluon_no_prefetch_us=[round(u, 1) for u in us_nopf],
            gluon_16row_blocks_us=[round(u, 1) for u in us_16],
            permute_us=[round(u, 1) for u in us_perm],
            gluon_vs_triton_max_abs=diff,
            max_abs=scale,
            rel_err_vs_reference_triton=err_old,
            rel_err_vs_reference_gluon=err_new,
        )
        rows.append(r)
        print(
            f"T={T:5d} I={I}: Triton {us_old[0]:8.1f} / {us_old[1]:8.1f} us  Gluon {us_new[0]:8.1f} / {us_new[1]:8.1f}"
            f" us ({nbytes / min(us_new) / 1e6:.2f} TB/s), no prefetch {min(us_nopf):.1f}, 16-row blocks"
            f" {min(us_16):.1f}  permute {min(us_perm):.1f} us  |new-old| {diff:.3g} of"
            f" {scale:.3g}  ref rel err {err_old:.2e} / {err_new:.2e}",
            flush=True,
        )
    print(save_json("int4_gemm1_gluon.json", rows))


if __name__ == "__main__":
    main()
