"""The routed experts of a tiny batch (decode at batch 1-2: a few (token, k) pairs) as GEMVs.

With one row per expert, tl.dot pads each pair to a 16-row tile and the GEMMs of fused_moe stream the weights
through the tensor-core path at ~2.3 TB/s. Here each program owns one pair and BLOCK_N output rows, reads the
weight tile in its natural layout (contiguous along K: 16-byte vector loads), multiplies by the token's row in
fp32 FMAs and reduces once at the end. No align step: the pair's expert is read straight from topk_ids.
Output: y [T*K, D] per pair (top-k weight applied); fused_moe's sum kernel adds the pairs up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["expert_offset"])
def _gemv1_kernel(X, W13, Hbuf, TopkIds, I, D, stride_xt, stride_we, stride_wn, stride_hm, expert_offset, E_LOCAL,
                  TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Hbuf[p, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for pair p = (tok, k) of expert e."""
    p = tl.program_id(0)
    e = (tl.load(TopkIds + p) - expert_offset).to(tl.int64)
    if (e < 0) | (e >= E_LOCAL):  # another rank's expert (EP): nothing to do
        return
    tok = (p // TOPK).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    g_ptr = W13 + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [N, K]
    u_ptr = g_ptr + I * stride_wn
    x_ptr = X + tok * stride_xt + offs_k
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            xk = tl.load(x_ptr + k0).to(tl.float32)
            g = tl.load(g_ptr + k0, mask=n_ok[:, None], other=0.0)
            u = tl.load(u_ptr + k0, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < D - k0
            xk = tl.load(x_ptr + k0, mask=k_ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            u = tl.load(u_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g += g.to(tl.float32) * xk[None, :]
        acc_u += u.to(tl.float32) * xk[None, :]
    sg = tl.sum(acc_g, 1)
    su = tl.sum(acc_u, 1)
    h = sg * tl.sigmoid(sg) * su
    tl.store(Hbuf + p.to(tl.int64) * stride_hm + offs_n, h.to(Hbuf.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["expert_offset"])
def _gemv2_kernel(Hbuf, W2, Y, TopkIds, TopkW, D, I, stride_hm, stride_we, stride_wn, stride_yt, expert_offset,
                  E_LOCAL, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Y[p, n] = topk_weight[p] * (Hbuf[p] . w2[e, n])."""
    p = tl.program_id(0)
    e = (tl.load(TopkIds + p) - expert_offset).to(tl.int64)
    if (e < 0) | (e >= E_LOCAL):
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    w_ptr = W2 + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [N, K]
    h_ptr = Hbuf + p.to(tl.int64) * stride_hm + offs_k
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            hk = tl.load(h_ptr + k0).to(tl.float32)
            w = tl.load(w_ptr + k0, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < I - k0
            hk = tl.load(h_ptr + k0, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * hk[None, :]
    y = tl.sum(acc, 1) * tl.load(TopkW + p)
    tl.store(Y + p.to(tl.int64) * stride_yt + offs_n, y.to(Y.dtype.element_ty), mask=n_ok)


def _block_k(K: int, cap: int) -> int:
    """The largest power of two <= cap dividing K (no masks), else cap."""
    b = cap
    while b >= 32 and K % b:
        b //= 2
    return b if K % b == 0 else cap


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, ids: torch.Tensor,
             expert_offset: int, config: dict | None = None) -> torch.Tensor:
    """x [T, D]; w13 [E, 2I, D]; w2 [E, D, I]; topk_weights [T*K] fp32, ids [T*K] (flat) -> y [T*K, D] in x.dtype,
    rows of pairs whose expert is not local left unwritten. config: BLOCK_N1/BLOCK_K1/BLOCK_N2/BLOCK_K2, num_warps."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I, TK = I2 // 2, ids.numel()
    K = TK // max(T, 1)
    c = dict(BLOCK_N1=16, BLOCK_K1=_block_k(D, 256), BLOCK_N2=16, BLOCK_K2=_block_k(I, 128), num_warps=4)
    c.update(config or {})
    hbuf = torch.empty(TK, I, dtype=x.dtype, device=x.device)
    _gemv1_kernel[(TK, triton.cdiv(I, c["BLOCK_N1"]))](
        x, w13, hbuf, ids, I, D, x.stride(0), w13.stride(0), w13.stride(1), hbuf.stride(0), expert_offset, E,
        TOPK=K, BLOCK_N=c["BLOCK_N1"], BLOCK_K=c["BLOCK_K1"], EVEN_K=D % c["BLOCK_K1"] == 0,
        num_warps=c["num_warps"])
    y = torch.empty(TK, D, dtype=x.dtype, device=x.device)
    _gemv2_kernel[(TK, triton.cdiv(D, c["BLOCK_N2"]))](
        hbuf, w2, y, ids, topk_weights, D, I, hbuf.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        expert_offset, E, BLOCK_N=c["BLOCK_N2"], BLOCK_K=c["BLOCK_K2"], EVEN_K=I % c["BLOCK_K2"] == 0,
        num_warps=c["num_warps"])
    return y
