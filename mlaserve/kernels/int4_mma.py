"""The INT4 (W4A16) MoE of a decode step as grouped GEMVs on the tensor cores: packed weights unpacked in registers
to bf16 with one LOP3 per two weights, dotted with x by `mma.sync` (fp32 accumulation), scaled per group in fp32.

Why: the FMA form (int4_gemv.py) spends ~3.3 instructions a weight (unpack, FMA, layout shuffles through shared
memory); here a weight costs ~0.9 integer and ~0.4 other instructions, which leaves the issue slots to the loads.
What sets the speed is then how many programs stream at once: 64-register tiles, 8 programs an SM (int4_mma_run).

Layout (compressed-tensors pack-quantized, QUANT_SPEC.md): row r of a weight is int32 words [K/8], column c's
nibble at bits 4*(c % 8) of word c // 8, stored n = q + 8; bf16 scales [K/32]; w[r, c] = (n - 8) * scale[r, c // 32].

Lanes. Every tile is a logical [MR, 128 * WG] tensor that Triton lays out as 16-byte vectors, lane l of warp w
holding columns 128 w + 4 l .. + 3 (checked on the compiled kernel: `check_layout`). Lane (g = l // 4, t = l % 4)
of warp column wg holds, for logical row m, the 4 words of group 4 wg + t (of the trip) of the "top" row 8 m + g
and of the "bottom" row (gemv1: the up row of gate row 8 m + g; gemv2: row 8 (MR + m) + g). So the 4 lanes t of a
quad share the rows, and the 8 quads of a warp share the 4 groups.
Unpack: for nibble pair j (nibbles j, j + 4 at bits 4j, 4j + 16), (w >> (4j - 3)) & 0x00780078 | 0x43004300 is a
bf16 pair (128 + 8 n_j, 128 + 8 n_{j+4}), exact.
MMA (m16n8k16, A row-major 16x16 bf16, B 16x8): A rows 0-7 are the quads' top rows, rows 8-15 their bottom rows,
lane (g, t) holding k-slots 2t, 2t + 1, 2t + 8, 2t + 9 of both. B column n comes from the lanes (n, t'); only the
diagonal lanes (n, n), n < 4, load x (the x of group n, the rest of B is zero), so D[g][n] is the dot of quad g's
rows with group n alone: lane (g, t < 2) gets groups 2t, 2t + 1 of its top row (c0, c1) and bottom row (c2, c3),
ready for their fp32 scales. Columns 4-7 serve a second token of the same expert (token B) for free: the lanes
(n + 4, n) load its x, and lane (g, t >= 2) gets its groups 2 (t - 2), 2 (t - 2) + 1.
A k-slot pair holds nibble pair (j, j + 4), B the matching x pair, so
    D = sum_c (128 + 8 n_c) x_c - 192 sum_c x_c = 8 sum_c (n_c - 8) x_c,
the -192 x sums (same for all rows) coming from one more chain of MMAs per trip (A = -192) and seeding C.
fp32 products are exact; the cancellation costs ~2^-19 relative. The final sums are scaled by 1/8 (exact).

gemv1: H[p, n] = silu(x[tok] . gate[e, n]) * (x[tok] . up[e, n]), stored with each 8 columns as pairs (j, j + 4)
(so gemv2 loads its B operand as is). gemv2: Y[p, d] = topk_weight[p] * (H[p] . down[e, d]).
"""

from __future__ import annotations

import re

import triton
import triton.language as tl

from .pdl import pdl_wait

MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
# x pairs (x[8e + j], x[8e + j + 4]) of word e from its natural pairs P[4e + i] = (x[8e + 2i], x[8e + 2i + 1])
PREP_ASM = tl.constexpr("""{ // int4_mma:prep
prmt.b32 $0, $4, $6, 0x5410;
prmt.b32 $1, $4, $6, 0x7632;
prmt.b32 $2, $5, $7, 0x5410;
prmt.b32 $3, $5, $7, 0x7632;
}""")
# -192 * (sum of the group's x) for c0..c3 of every lane: A = -192 everywhere, B = the 16 x-pair registers
XSUM_ASM = tl.constexpr(
    "{ // int4_mma:xsum\n.reg .b32 c;\n.reg .f32 d<4>;\nmov.b32 c, 0xC340C340;\n"
    + "".join(f"mov.f32 d{i}, 0f00000000;\n" for i in range(4))
    + "".join(
        f"{MMA} {{d0,d1,d2,d3}}, {{c,c,c,c}}, {{${4 + 2 * i},${5 + 2 * i}}}, {{d0,d1,d2,d3}};\n" for i in range(8)
    )
    + "".join(f"mov.f32 ${i}, d{i};\n" for i in range(4))
    + "}"
)


def _unpack(src: str, dst: str, mul: bool) -> str:
    """The 4 bf16 pairs of word `src` into registers dst0..dst3 (pair j: nibbles j, j + 4). mul: the right shifts as
    mul.hi (the FMA pipe's IMAD.HI) instead of shr (the integer pipe's SHF, which the LOP3s also need)."""
    ops = ["shl.b32 t, {}, 3"]
    ops += [f"mul.hi.u32 t, {{}}, {1 << (32 - s):#010x}" if mul else f"shr.u32 t, {{}}, {s}" for s in (1, 5, 9)]
    out = []
    for j, op in enumerate(ops):
        out += [op.format(src) + ";", f"lop3.b32 {dst}{j}, t, 0x00780078, k, 0xEA;"]  # (t & mask) | k
    return "\n".join(out) + "\n"


# acc' = acc + scale * D over one trip's 4 words of a top and a bottom row. Operands: $0-3 acc' (f32); $4-7 top
# words, $8-11 bottom words, $12-27 x pairs (word e, pair j: $12 + 4e + j), $28-31 the -192 x sums (f32), $32-33
# top scales (bf16 x4: groups 0-3 of the warp's trip), $34-35 bottom scales, $36-39 acc (f32). Lane t = laneid % 4
# takes the scales of groups 2 (t % 2), 2 (t % 2) + 1 (PRMT selector 0x3210 or 0x7654).


def _main_asm(mul: bool) -> str:
    return (
        "{ // int4_mma:main\n.reg .b32 t, k, st, sb, a<4>, b<4>;\n.reg .f32 d<4>, s<4>;\nmov.b32 k, 0x43004300;\n"
        + "".join(f"mov.f32 d{i}, ${28 + i};\n" for i in range(4))
        + "".join(
            _unpack(f"${4 + e}", "a", mul)
            + _unpack(f"${8 + e}", "b", mul)
            + f"{MMA} {{d0,d1,d2,d3}}, {{a0,b0,a1,b1}}, {{${12 + 4 * e},${13 + 4 * e}}}, {{d0,d1,d2,d3}};\n"
            + f"{MMA} {{d0,d1,d2,d3}}, {{a2,b2,a3,b3}}, {{${14 + 4 * e},${15 + 4 * e}}}, {{d0,d1,d2,d3}};\n"
            for e in range(4)
        )
        + "mov.u32 t, %laneid;\nand.b32 t, t, 1;\nmad.lo.u32 t, t, 0x4444, 0x3210;\n"
        + "prmt.b32 st, $32, $33, t;\nprmt.b32 sb, $34, $35, t;\n"
        + "shl.b32 s0, st, 16;\nand.b32 s1, st, 0xFFFF0000;\nshl.b32 s2, sb, 16;\nand.b32 s3, sb, 0xFFFF0000;\n"
        + "".join(f"fma.rn.f32 ${i}, d{i}, s{i}, ${36 + i};\n" for i in range(4))
        + "}"
    )


MAIN_ASM = tl.constexpr(_main_asm(False))
MAIN_ASM_MUL = tl.constexpr(_main_asm(True))
MAIN_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 24 + ["f"] * 4 + ["r"] * 4 + ["f"] * 4))
PREP_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,r,r,r,r")
XSUM_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 16))


@triton.jit
def _lanes(WG: tl.constexpr):
    """Per logical column v [1, 128 WG]: the word offset in a row (group 4 wg + t, word e), the scale offset (group
    4 wg + e), the x-pair offset (group 4 wg + t, pair e), the lanes that load x (the diagonal (t, t): token A;
    (t + 4, t): token B, a second pair of the same expert, when there is one), the trip group of the lane's words."""
    v = tl.arange(0, 128 * WG)[None, :]
    t = (v // 4) % 4
    grp = 4 * (v // 128) + t
    woff = 16 * (v // 128) + v % 16
    sgrp = 4 * (v // 128) + v % 4
    xoff = 16 * grp + v % 4
    diag = (v // 16) % 8 == t
    diag_b = (v // 16) % 8 == t + 4
    return woff, sgrp, xoff, diag, diag_b, grp


@triton.jit
def _trip_w(W, Wb, S, Sb, wrow, srow, t_ok, b_ok, g0, NG, woff, sgrp, grp, EVEN: tl.constexpr):
    """Words [MR, V] of the top / bottom rows and their scales [MR, V] (bf16, groups 4 wg + e) for trip g0: W / Wb,
    S / Sb the top / bottom rows' word and scale bases, wrow / srow [MR, V] int32 each lane's row offsets. t_ok /
    b_ok: which top / bottom rows are real. EVEN: all are, and NG is a multiple of the trip."""
    if EVEN:
        on = g0 < NG
        wt = tl.load(W + (wrow + 4 * g0 + woff), mask=on)
        wb = tl.load(Wb + (wrow + 4 * g0 + woff), mask=on)
        st = tl.load(S + (srow + g0 + sgrp), mask=on)
        sb = tl.load(Sb + (srow + g0 + sgrp), mask=on)
    else:
        wm = g0 + grp < NG
        sm = g0 + sgrp < NG
        wt = tl.load(W + (wrow + 4 * g0 + woff), mask=t_ok & wm, other=0)
        wb = tl.load(Wb + (wrow + 4 * g0 + woff), mask=b_ok & wm, other=0)
        st = tl.load(S + (srow + g0 + sgrp), mask=t_ok & sm, other=0.0)
        sb = tl.load(Sb + (srow + g0 + sgrp), mask=b_ok & sm, other=0.0)
    return wt, wb, st, sb


@triton.jit
def _trip_x(xa_ptr, xb_ptr, has_b, g0, NG, xoff, diag, diag_b, grp, PERM: tl.constexpr):
    """The x pairs of the lanes' group [1, V] x 4 (pair registers of words 0..3): token A's (xa_ptr) on the diagonal
    lanes, token B's (xb_ptr, if has_b) on the second diagonal, zero elsewhere; and the -192 x sums (D columns 0-3
    token A's, 4-7 token B's). PERM: x is stored as pairs (j, j + 4) already (gemv1's H)."""
    on = (diag | (diag_b & has_b)) & (g0 + grp < NG)
    off = 16 * g0 + xoff
    y0 = tl.load(tl.where(diag, xa_ptr, xb_ptr) + off, mask=on, other=0)
    y1 = tl.load(tl.where(diag, xa_ptr, xb_ptr) + (off + 4), mask=on, other=0)
    y2 = tl.load(tl.where(diag, xa_ptr, xb_ptr) + (off + 8), mask=on, other=0)
    y3 = tl.load(tl.where(diag, xa_ptr, xb_ptr) + (off + 12), mask=on, other=0)
    if not PERM:
        y0 = tl.inline_asm_elementwise(PREP_ASM, PREP_CONSTRAINTS, [y0], dtype=tl.int32, is_pure=True, pack=4)
        y1 = tl.inline_asm_elementwise(PREP_ASM, PREP_CONSTRAINTS, [y1], dtype=tl.int32, is_pure=True, pack=4)
        y2 = tl.inline_asm_elementwise(PREP_ASM, PREP_CONSTRAINTS, [y2], dtype=tl.int32, is_pure=True, pack=4)
        y3 = tl.inline_asm_elementwise(PREP_ASM, PREP_CONSTRAINTS, [y3], dtype=tl.int32, is_pure=True, pack=4)
    xs = tl.inline_asm_elementwise(XSUM_ASM, XSUM_CONSTRAINTS, [y0, y1, y2, y3], dtype=tl.float32, is_pure=True, pack=4)
    return y0, y1, y2, y3, xs


@triton.jit
def _mma(wt, wb, st, sb, y0, y1, y2, y3, xs, acc, MUL: tl.constexpr):
    if MUL:
        return tl.inline_asm_elementwise(
            MAIN_ASM_MUL,
            MAIN_CONSTRAINTS,
            [wt, wb, y0, y1, y2, y3, xs, st, sb, acc],
            dtype=tl.float32,
            is_pure=True,
            pack=4,
        )
    return tl.inline_asm_elementwise(
        MAIN_ASM,
        MAIN_CONSTRAINTS,
        [wt, wb, y0, y1, y2, y3, xs, st, sb, acc],
        dtype=tl.float32,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _mma_dot(
    W,
    Wb,
    S,
    Sb,
    wrow,
    srow,
    t_ok,
    b_ok,
    xa_ptr,
    xb_ptr,
    has_b,
    NG,
    MR: tl.constexpr,
    WG: tl.constexpr,
    EVEN: tl.constexpr,
    PERM: tl.constexpr,
    PREFETCH: tl.constexpr,
    WAIT: tl.constexpr,
    MUL: tl.constexpr,
    NS: tl.constexpr,
    NGC: tl.constexpr = 0,
):
    """8 * sum over the K = 32 NG columns of the top and bottom rows' w . x, as acc [MR, 128 WG] (lanes above).
    W / Wb, S / Sb: the top / bottom rows' word / scale bases; wrow / srow [MR, 128 WG] int32: each element's row
    offset from them (words / scales); xa_ptr / xb_ptr: tokens A / B's x as int32 pairs (has_b: B is real), whose
    sums land in the lanes t < 2 / t >= 2. PREFETCH:
    each trip's loads are issued before the previous trip's MMAs (in registers). NS > 1: trips after the first are
    loaded NS - 1 ahead by cp.async into shared memory (Triton's pipeliner), which holds far more bytes in flight
    than registers. WAIT: the kernel's PDL wait comes between the first trip's weights and its x. NGC > 0: NG known
    at compile time (= NGC) and every trip unrolled, the same sums in the same order: a runtime loop's next-trip
    loads are placed by ptxas at the end of the loop body, just before their use, where unrolled ones spread over
    the trips before (as many as the register budget holds)."""
    woff, sgrp, xoff, diag, diag_b, grp = _lanes(WG)
    acc = tl.zeros([MR, 128 * WG], tl.float32)
    TRIP: tl.constexpr = 4 * WG
    if NGC > 0:
        for g0 in tl.static_range(0, NGC, TRIP):
            wt, wb, st, sb = _trip_w(W, Wb, S, Sb, wrow, srow, t_ok, b_ok, g0, NGC, woff, sgrp, grp, EVEN)
            if g0 == 0:
                pdl_wait(WAIT)
            y0, y1, y2, y3, xs = _trip_x(xa_ptr, xb_ptr, has_b, g0, NGC, xoff, diag, diag_b, grp, PERM)
            acc = _mma(wt, wb, st, sb, y0, y1, y2, y3, xs, acc, MUL)
        return acc
    wt, wb, st, sb = _trip_w(W, Wb, S, Sb, wrow, srow, t_ok, b_ok, 0, NG, woff, sgrp, grp, EVEN)
    pdl_wait(WAIT)
    y0, y1, y2, y3, xs = _trip_x(xa_ptr, xb_ptr, has_b, 0, NG, xoff, diag, diag_b, grp, PERM)
    if PREFETCH:
        for g0 in range(TRIP, NG + TRIP, TRIP):
            nt, nb, nst, nsb = _trip_w(W, Wb, S, Sb, wrow, srow, t_ok, b_ok, g0, NG, woff, sgrp, grp, EVEN)
            n0, n1, n2, n3, nxs = _trip_x(xa_ptr, xb_ptr, has_b, g0, NG, xoff, diag, diag_b, grp, PERM)
            acc = _mma(wt, wb, st, sb, y0, y1, y2, y3, xs, acc, MUL)
            wt, wb, st, sb, y0, y1, y2, y3, xs = nt, nb, nst, nsb, n0, n1, n2, n3, nxs
    else:
        acc = _mma(wt, wb, st, sb, y0, y1, y2, y3, xs, acc, MUL)
        for g0 in tl.range(TRIP, NG, TRIP, num_stages=NS):
            wt, wb, st, sb = _trip_w(W, Wb, S, Sb, wrow, srow, t_ok, b_ok, g0, NG, woff, sgrp, grp, EVEN)
            y0, y1, y2, y3, xs = _trip_x(xa_ptr, xb_ptr, has_b, g0, NG, xoff, diag, diag_b, grp, PERM)
            acc = _mma(wt, wb, st, sb, y0, y1, y2, y3, xs, acc, MUL)
    return acc


@triton.jit
def _row_sums(acc, MR: tl.constexpr, WG: tl.constexpr):
    """acc [MR, 128 WG] -> [MR, 8, 2, 2] fp32 (row 8 m + g, token A / B, top / bottom row): each row's dot (lane
    (g, t) elements 0, 1 top, 2, 3 bottom, of token A for t < 2, token B for t >= 2), times the 1/8 of the
    unpack's scaling."""
    a = tl.reshape(acc, (MR, WG, 8, 2, 2, 2, 2))  # m, wg, g, token, t % 2, top / bottom, group parity
    a = tl.sum(tl.sum(tl.sum(a, 6), 4), 1)  # [MR, 8, 2, 2]
    return a * 0.125


_LAYOUT = re.compile(r"#(\w+) = #ttg\.blocked<\{(.*?)\}>")
_CHECKED: set = set()


def _layout_ok(ttgir: str, WG: int) -> str:
    """'' if every inline-asm op of the kernel works on 16-byte lane vectors laid out as int4_mma.py assumes, else
    what differs."""
    want = f"sizePerThread = [1, 4], threadsPerWarp = [1, 32], warpsPerCTA = [1, {WG}], order = [1, 0]"
    layouts = {m.group(1): m.group(2) for m in _LAYOUT.finditer(ttgir)}
    for line in ttgir.splitlines():
        if "tt.elementwise_inline_asm" not in line:
            continue
        bad = [x for x in re.findall(r"tensor<[^>]*#(\w+)>", line) if layouts.get(x) != want]
        if bad:
            return f"inline asm on #{bad[0]} = {layouts.get(bad[0], 'a non-blocked layout')}, want {want}"
    return ""


def check_layout(kernel, WG: int) -> None:
    """Raise if the compiled kernel's tiles are not laid out as the MMA lanes assume (a Triton whose layouts
    differ would give wrong sums silently). Once per compiled kernel."""
    asm = getattr(kernel, "asm", None)
    key = (getattr(kernel, "hash", None), WG)
    if asm is None or key in _CHECKED:  # the interpreter, or checked
        return
    why = _layout_ok(asm["ttgir"], WG)
    if why:
        raise RuntimeError(f"int4 MMA GEMV: {why}; run with config form='gemv_fma'")
    _CHECKED.add(key)
