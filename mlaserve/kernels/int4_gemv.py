"""The INT4 (W4A16) MoE of a decode step as grouped GEMVs: packed weight rows streamed whole, unpacked in registers.

Layout (compressed-tensors pack-quantized, docs/design.md section 5): row r of a weight is int32 words [K/8],
column c's nibble at bits 4*(c % 8) of word c // 8, stored q + 8; bf16 scales [K/32];
w[r, c] = (nibble - 8) * scale[r, c // 32].

A program owns ROWS rows of one (token, k) pair's expert and walks their K extent G groups (of 32 columns, 4 words)
per trip: the words come as [ROWS, 4G] (16-byte loads, each row's bytes contiguous; warps on rows, lanes on
groups, so the x a thread prepares serves all its rows), the scales as [ROWS, G].
Unpack, per word: nibble pair p (nibbles 2p, 2p+1) rotated left by 15 - 8p puts nibble 2p+1 at mantissa bits
19-22 and nibble 2p at 15-18; OR-ed under the exponent of 1.0 the bits read as f = 1 + n/16 and 1 + n/256. So a
weight costs half a rotate, one LOP3 and one FMA against x' (x for odd nibbles, 16 x for even ones, so both carry
n x / 16), and per group, with the x sums xs (all 32 columns) and xe (the even nibbles') taken once per trip:
    sum_c (n_c - 8) x_c = 16 * sum_c f_c x'_c - 24 xs - 240 xe,
then times the group's scale. No integer-to-float conversion (a 16-per-clock pipe) and no division in the loop;
the cancellation costs about 2^-17 relative (fp32 accumulation throughout).

gemv1: H[p, n] = silu(x[tok] . gate[e, n]) * (x[tok] . up[e, n]), gate and up rows of w13 in one tile.
gemv2: Y[p, d] = topk_weight[p] * (H[p] . down[e, d]). Pairs of experts outside [offset, offset + E) exit at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_release, pdl_wait

ONE_BITS = 0x3F800000  # the bits of 1.0f: a kernel argument, so it sits in a register (one LOP3 per nibble)
MANT = tl.constexpr(0x00780000)  # mantissa bits 19-22: a nibble there adds n/16
MANT_LO = tl.constexpr(0x00078000)  # mantissa bits 15-18: a nibble there adds n/256


@triton.jit
def _trip_weights(w_ptr, s_ptr, r_ok, g0, NG, G: tl.constexpr, EVEN: tl.constexpr):
    """Groups [g0, g0 + G) of rows r (w_ptr / s_ptr [R]: each row's words / scales): words [R, 4G] int32 and scales
    [R, G]; nothing past NG groups (a trip past the end loads nothing). EVEN: NG % G == 0 and every row is real
    (r_ok all true), so whole trips load unmasked."""
    g = g0 + tl.arange(0, G)
    v = 4 * g0 + tl.arange(0, 4 * G)
    if EVEN:  # whole trips and row blocks: only a trip past the end is masked (off)
        w = tl.load(w_ptr[:, None] + v[None, :], mask=g0 < NG)
        s = tl.load(s_ptr[:, None] + g[None, :], mask=g0 < NG)
    else:
        w = tl.load(w_ptr[:, None] + v[None, :], mask=r_ok[:, None] & (v < 4 * NG)[None, :], other=0)
        s = tl.load(s_ptr[:, None] + g[None, :], mask=r_ok[:, None] & (g < NG)[None, :], other=0.0)
    return w, s


@triton.jit
def _trip_x(x_ptr, g0, NG, G: tl.constexpr, EVEN: tl.constexpr):
    """x of groups [g0, g0 + G): [32G]."""
    c = 32 * g0 + tl.arange(0, 32 * G)
    if EVEN:
        return tl.load(x_ptr + c, mask=g0 < NG)
    return tl.load(x_ptr + c, mask=c < 32 * NG, other=0.0)


@triton.jit
def _trip_dot(w, s, x, one):
    """One trip's sum_c (n_c - 8) x_c per row and group, times the group's scale -> [R, G] fp32."""
    R: tl.constexpr = w.shape[0]
    G: tl.constexpr = s.shape[1]
    even = (tl.arange(0, 8) % 2 == 0)[None, None, :]
    x = tl.reshape(x.to(tl.float32), (G, 4, 8))
    xs = tl.sum(tl.sum(x, 2), 1)  # [G]
    xe = tl.sum(tl.sum(tl.where(even, x, 0.0), 2), 1)  # [G]: the even nibbles' columns
    x = tl.reshape(tl.where(even, 16.0 * x, x), (G, 32))
    # nibble pair p (nibbles 2p, 2p + 1) rotated left by 15 - 8p (mod 32): 2p + 1 to bits 19-22, 2p to 15-18
    rot = ((15 - 8 * tl.arange(0, 4)) & 31).to(tl.uint32)[None, None, None, :]
    u = tl.reshape(w, (R, G, 4, 1)).to(tl.uint32, bitcast=True)
    t = (u << rot) | (u >> ((32 - rot) & 31))  # [R, G, 4, 4]
    f_even = ((t & MANT_LO) | one).to(tl.float32, bitcast=True)  # 1 + n/256, against 16 x
    f_odd = ((t & MANT) | one).to(tl.float32, bitcast=True)  # 1 + n/16
    f = tl.reshape(tl.join(f_even, f_odd), (R, G, 32))  # column 8 * word + nibble
    part = tl.sum(f * x[None], 2)  # [R, G]: one FMA chain a row and group
    return (16.0 * part - 24.0 * xs[None, :] - 240.0 * xe[None, :]) * s.to(tl.float32)


@triton.jit
def _rows_dot(
    w_ptr, s_ptr, r_ok, x_ptr, NG, one, G: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr, WAIT: tl.constexpr
):
    """sum_c w[r, c] x[c] over the K = 32 * NG columns of rows r: w_ptr / s_ptr [R] point at each row's words and
    scales, x_ptr at x[0] -> [R] fp32. PREFETCH: each trip's loads are issued before the previous trip's
    arithmetic (registers double-buffer the words), so a program always has a trip in flight. WAIT: the kernel's
    PDL wait comes between the first trip's weights and its x (x is the previous kernel's output)."""
    acc = tl.zeros([w_ptr.shape[0], G], tl.float32)
    if PREFETCH:
        w, s = _trip_weights(w_ptr, s_ptr, r_ok, 0, NG, G, EVEN)
        pdl_wait(WAIT)
        x = _trip_x(x_ptr, 0, NG, G, EVEN)
        for g0 in range(G, NG + G, G):
            w_next, s_next = _trip_weights(w_ptr, s_ptr, r_ok, g0, NG, G, EVEN)
            x_next = _trip_x(x_ptr, g0, NG, G, EVEN)
            acc += _trip_dot(w, s, x, one)
            w, s, x = w_next, s_next, x_next
    else:
        g_first = 0
        if WAIT:  # the first trip peeled off the loop, the wait inside it
            w, s = _trip_weights(w_ptr, s_ptr, r_ok, 0, NG, G, EVEN)
            pdl_wait(WAIT)
            acc += _trip_dot(w, s, _trip_x(x_ptr, 0, NG, G, EVEN), one)
            g_first = G
        for g0 in range(g_first, NG, G):
            w, s = _trip_weights(w_ptr, s_ptr, r_ok, g0, NG, G, EVEN)
            acc += _trip_dot(w, s, _trip_x(x_ptr, g0, NG, G, EVEN), one)
    return tl.sum(acc, 1)


@triton.jit
def _pair(p, TopkIds, expert_offset, E_LOCAL, CG: tl.constexpr):
    """Local expert of pair p (int64) and whether this rank owns it."""
    if CG:
        e = tl.load(TopkIds + p, cache_modifier=".cg").to(tl.int64) - expert_offset
    else:
        e = tl.load(TopkIds + p).to(tl.int64) - expert_offset
    return e, (e >= 0) & (e < E_LOCAL)


@triton.jit(do_not_specialize=["expert_offset"])
def _int4_gemv1_kernel(
    X,
    W13,
    S13,
    Hbuf,
    TopkIds,
    I,
    NG,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_hm,
    expert_offset,
    E_LOCAL,
    one,
    TOPK: tl.constexpr,
    ROWS: tl.constexpr,
    G: tl.constexpr,
    EVEN: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Hbuf[p, n] for ROWS rows n of pair p = program // cdiv(I, ROWS): gate row n and up row I + n interleaved in
    one [2 * ROWS] tile."""
    pdl_wait(PDL)
    pdl_release(PDL)  # only now: gemv2 reads the routing before its own wait (pdl.py)
    nb = tl.cdiv(I, ROWS)
    p = tl.program_id(0) // nb
    e, own = _pair(p, TopkIds, expert_offset, E_LOCAL, False)
    if not own:
        return
    r2 = tl.arange(0, 2 * ROWS)
    n = (tl.program_id(0) % nb) * ROWS + r2 // 2
    r_ok = n < I
    row = (n + (r2 % 2) * I).to(tl.int64)  # even: gate row n, odd: up row n
    w_ptr = W13 + e * stride_we + row * stride_wn
    s_ptr = S13 + e * stride_se + row * stride_sn
    acc = _rows_dot(w_ptr, s_ptr, r_ok, X + (p // TOPK) * stride_xt, NG, one, G, EVEN, PREFETCH, False)
    gate, up = tl.split(tl.reshape(acc, (ROWS, 2)))
    h = gate * tl.sigmoid(gate) * up
    n1 = (tl.program_id(0) % nb) * ROWS + tl.arange(0, ROWS)
    tl.store(Hbuf + p * stride_hm + n1, h.to(Hbuf.dtype.element_ty), mask=n1 < I)


@triton.jit(do_not_specialize=["expert_offset"])
def _int4_gemv2_kernel(
    Hbuf,
    W2,
    S2,
    Y,
    TopkW,
    TopkIds,
    D,
    NG,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_yt,
    expert_offset,
    E_LOCAL,
    one,
    ROWS: tl.constexpr,
    G: tl.constexpr,
    EVEN: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Y[p, d] for ROWS rows d of pair p = program // cdiv(D, ROWS). The routing is read before the PDL wait, through
    L2 (gemv1 released this kernel only after its own wait, so the routing was complete: pdl.py), and so are the
    first trip's weights: only Hbuf waits."""
    pdl_release(PDL)
    nb = tl.cdiv(D, ROWS)
    p = tl.program_id(0) // nb
    e, own = _pair(p, TopkIds, expert_offset, E_LOCAL, PDL)
    if not own:
        return
    d = (tl.program_id(0) % nb) * ROWS + tl.arange(0, ROWS)
    d_ok = d < D
    w_ptr = W2 + e * stride_we + d.to(tl.int64) * stride_wn
    s_ptr = S2 + e * stride_se + d.to(tl.int64) * stride_sn
    tw = tl.load(TopkW + p, cache_modifier=".cg")
    acc = _rows_dot(w_ptr, s_ptr, d_ok, Hbuf + p * stride_hm, NG, one, G, EVEN, PREFETCH, PDL)
    tl.store(Y + p * stride_yt + d, (acc * tw).to(Y.dtype.element_ty), mask=d_ok)


def int4_gemv(x, w13, s13, w2, s2, topk_weights, topk_ids, expert_offset, hbuf, y, pdl, c1, c2):
    """Both GEMVs into hbuf [TK, I] and y [TK, D] (the caller checked every shape). c1 / c2: gemv1 / gemv2 configs
    {"ROWS", "G", "num_warps"} and optionally "PREFETCH", "num_stages", "maxnreg" (a register cap, for more programs an
    SM) (ROWS of gemv1: gate rows, each with its up row)."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    K = topk_ids.shape[-1]
    ids = topk_ids.reshape(-1)
    ng1, ng2 = D // 32, I // 32
    _int4_gemv1_kernel[(T * K * triton.cdiv(I, c1["ROWS"]),)](
        x,
        w13,
        s13,
        hbuf,
        ids,
        I,
        ng1,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        hbuf.stride(0),
        expert_offset,
        E,
        ONE_BITS,
        TOPK=K,
        ROWS=c1["ROWS"],
        G=c1["G"],
        EVEN=ng1 % c1["G"] == 0 and I % c1["ROWS"] == 0,
        PREFETCH=c1.get("PREFETCH", ng1 > c1["G"]),
        num_warps=c1["num_warps"],
        num_stages=c1.get("num_stages", 2),
        maxnreg=c1.get("maxnreg"),
        **pdl,
    )
    _int4_gemv2_kernel[(T * K * triton.cdiv(D, c2["ROWS"]),)](
        hbuf,
        w2,
        s2,
        y,
        topk_weights.reshape(-1),
        ids,
        D,
        ng2,
        hbuf.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        y.stride(0),
        expert_offset,
        E,
        ONE_BITS,
        ROWS=c2["ROWS"],
        G=c2["G"],
        EVEN=ng2 % c2["G"] == 0 and D % c2["ROWS"] == 0,
        PREFETCH=c2.get("PREFETCH", ng2 > c2["G"]),
        num_warps=c2["num_warps"],
        num_stages=c2.get("num_stages", 2),
        maxnreg=c2.get("maxnreg"),
        **pdl,
    )
