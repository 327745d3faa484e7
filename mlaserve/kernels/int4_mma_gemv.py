"""The INT4 MoE's two GEMVs on the tensor cores (the dot itself: int4_mma.py), and the check that the compiled
kernels place the tiles as that dot assumes.

gemv1: program (pair p, gate rows n0 .. n0 + 8 MR) -> Hbuf[p, n] = silu(gate . x) * (up . x), each 8 columns
stored as pairs (j, j + 4). gemv2: program (pair p, rows d0 .. d0 + 16 MR) -> Y[p, d] = topk_weight[p] * (down . H).
A program of WG warps walks K in trips of 4 WG groups (128 WG columns), each warp on 4 groups of every row. (Warps
on rows too would narrow the loads of x, a [1, 128 WG] tile, below 16 bytes a lane, and so change its layout.)
Pairs of experts outside [offset, offset + E) exit at once.
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from .int4_gemv import _pair
from .int4_mma import _lanes, _mma, _mma_dot, _row_sums, _trip_w, _trip_x
from .pdl import pdl_release, pdl_wait


@triton.jit(do_not_specialize=["expert_offset"])
def _int4_mma_gemv1_kernel(
    X32,
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
    stride_sn4,
    stride_hm,
    expert_offset,
    E_LOCAL,
    TOPK: tl.constexpr,
    MR: tl.constexpr,
    WG: tl.constexpr,
    EVEN: tl.constexpr,
    PREFETCH: tl.constexpr,
    MUL: tl.constexpr,
    NS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Hbuf[p, n] for the 8 MR gate rows n of program's block (top rows) and their up rows I + n (bottom rows)."""
    pdl_wait(PDL)
    pdl_release(PDL)  # only now: gemv2 reads the routing before its own wait (pdl.py)
    ROWS: tl.constexpr = 8 * MR
    nb = tl.cdiv(I, ROWS)
    p = tl.program_id(0) // nb
    e, own = _pair(p, TopkIds, expert_offset, E_LOCAL, False)
    if not own:
        return
    n0 = (tl.program_id(0) % nb) * ROWS
    m = tl.arange(0, MR)[:, None]
    n = n0 + 8 * m + (tl.arange(0, 128 * WG)[None, :] // 16) % 8  # [MR, V]: each lane's gate row
    W, S = W13 + e * stride_we, S13 + e * stride_se  # expert e; rows as int32 offsets (fewer registers)
    Wb, Sb = W + I * stride_wn, S + I * (4 * stride_sn4)
    x = X32 + (p // TOPK).to(tl.int64) * stride_xt
    wrow, srow = n * stride_wn, n * (4 * stride_sn4)
    acc = _mma_dot(W, Wb, S, Sb, wrow, srow, n < I, n < I, x, NG, MR, WG, EVEN, False, PREFETCH, False, MUL, NS)
    gate, up = _row_sums(acc, MR, WG)  # [MR, 8]
    h = gate * tl.sigmoid(gate) * up
    g = tl.arange(0, 8)[None, :]
    col = n0 + 8 * m + g
    pos = n0 + 8 * m + 2 * (g % 4) + g // 4  # column 8 i + j at 8 i + 2 (j % 4) + j // 4: pairs (j, j + 4)
    tl.store(Hbuf + p * stride_hm + pos, h.to(Hbuf.dtype.element_ty), mask=col < I)


@triton.jit
def _store_rows(acc, Y, r0, tw, D, MR: tl.constexpr, WG: tl.constexpr):
    """Y[r0 + r] = tw * (row r's sum) for the block's 16 MR rows (top: the first 8 MR)."""
    top, bot = _row_sums(acc, MR, WG)  # [MR, 8]
    rt = r0 + 8 * tl.arange(0, MR)[:, None] + tl.arange(0, 8)[None, :]
    tl.store(Y + rt, (top * tw).to(Y.dtype.element_ty), mask=rt < D)
    tl.store(Y + rt + 8 * MR, (bot * tw).to(Y.dtype.element_ty), mask=rt + 8 * MR < D)


@triton.jit(do_not_specialize=["expert_offset"])
def _int4_mma_gemv2_kernel(
    H32,
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
    stride_sn4,
    stride_yt,
    expert_offset,
    E_LOCAL,
    MR: tl.constexpr,
    WG: tl.constexpr,
    NB: tl.constexpr,
    EVEN: tl.constexpr,
    PREFETCH: tl.constexpr,
    MUL: tl.constexpr,
    NS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Y[p, d] for NB blocks of 16 MR rows d (top: a block's first 8 MR). The routing is read before the PDL wait
    through L2, and so are the first trip's weights (pdl.py): only Hbuf waits.
    NB > 1 (K in one trip, NG <= 4 WG): x is unpacked once, and the blocks' loads run NS - 1 blocks ahead."""
    pdl_release(PDL)
    ROWS: tl.constexpr = 16 * MR
    nprog = tl.cdiv(tl.cdiv(D, ROWS), NB)
    p = tl.program_id(0) // nprog
    e, own = _pair(p, TopkIds, expert_offset, E_LOCAL, PDL)
    if not own:
        return
    d0 = (tl.program_id(0) % nprog) * (NB * ROWS)
    m = tl.arange(0, MR)[:, None]
    dl = 8 * m + (tl.arange(0, 128 * WG)[None, :] // 16) % 8  # [MR, V]: each lane's top row in a block
    W, S = W2 + e * stride_we, S2 + e * stride_se
    Wb, Sb = W + 8 * MR * stride_wn, S + 8 * MR * (4 * stride_sn4)
    tw = tl.load(TopkW + p, cache_modifier=".cg")
    h = H32 + p.to(tl.int64) * stride_hm
    y = Y + p * stride_yt
    d = d0 + dl
    wrow, srow = d * stride_wn, d * (4 * stride_sn4)
    if NB == 1:
        acc = _mma_dot(
            W, Wb, S, Sb, wrow, srow, d < D, d + 8 * MR < D, h, NG, MR, WG, EVEN, True, PREFETCH, PDL, MUL, NS
        )
        _store_rows(acc, y, d0, tw, D, MR, WG)
    else:
        woff, sgrp, xoff, diag, grp = _lanes(WG)
        wt, wb, st, sb = _trip_w(W, Wb, S, Sb, wrow, srow, d < D, d + 8 * MR < D, 0, NG, woff, sgrp, grp, EVEN)
        pdl_wait(PDL)
        y0, y1, y2, y3, xs = _trip_x(h, 0, NG, xoff, diag, grp, True)
        zero = tl.zeros([MR, 128 * WG], tl.float32)
        _store_rows(_mma(wt, wb, st, sb, y0, y1, y2, y3, xs, zero, MUL), y, d0, tw, D, MR, WG)
        for r0 in tl.range(d0 + ROWS, tl.minimum(d0 + NB * ROWS, D), ROWS, num_stages=NS):
            d = r0 + dl
            wrow, srow = d * stride_wn, d * (4 * stride_sn4)
            wt, wb, st, sb = _trip_w(W, Wb, S, Sb, wrow, srow, d < D, d + 8 * MR < D, 0, NG, woff, sgrp, grp, EVEN)
            _store_rows(_mma(wt, wb, st, sb, y0, y1, y2, y3, xs, zero, MUL), y, r0, tw, D, MR, WG)


def mma_config(D: int, I: int, pairs: int) -> tuple[dict, dict]:
    """(gemv1, gemv2) tiles. gemv1 (K = D): 4 warps over trips of 16 groups, 8 MR gate rows (and their up rows) a
    program: MR 4 while that leaves 512 programs (one wave at 4 programs an SM), else one block of 8 rows with its
    next trips loaded ahead by cp.async (NS 3). gemv2 (K = I): 16 MR rows over trips of 4 WG groups (WG <= K/128)."""
    ng2 = I // 32
    mr1 = 4
    while mr1 > 1 and pairs * triton.cdiv(I, 8 * mr1) < 512:
        mr1 //= 2
    c1 = dict(MR=mr1, WG=4, MUL=False) if mr1 == 4 else dict(MR=mr1, WG=4, MUL=False, NS=3)
    wg2 = 4 if ng2 % 16 == 0 else 2 if ng2 % 8 == 0 else 1
    c2 = dict(MR=2, WG=wg2, MUL=False)
    return c1, c2


def mma_supported(x: torch.Tensor, D: int, I: int) -> bool:
    """The tensor-core GEMV needs bf16 activations on sm_80+ compiled kernels (mma.sync m16n8k16 bf16), x pairs
    addressable as int32 (even row stride), and rows whose words and scales start on 16 / 8 bytes (D, I multiples
    of 128: 16 words, 4 scales); everything else takes the FMA GEMV."""
    if x.dtype != torch.bfloat16 or D % 128 or I % 128 or x.stride(0) % 2 or x.storage_offset() % 2:
        return False
    if not x.is_cuda:
        import os

        return os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter tests emulate the MMA (tests/interp_mma.py)
    return torch.cuda.get_device_capability(x.device)[0] >= 8


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


def int4_gemv_mma(x, w13, s13, w2, s2, topk_weights, topk_ids, expert_offset, hbuf, y, pdl, c1, c2):
    """Both GEMVs into hbuf [TK, I] (bf16, pair order) and y [TK, D] (the caller checked every shape and
    mma_supported). c1 / c2: {"MR", "WG", "PREFETCH", "MUL", "NS", "maxnreg"} and c2's "NB" (gemv1: 8 MR gate rows
    a program, gemv2: NB blocks of 16 MR rows; WG warps; NS: cp.async stages; maxnreg: a register cap, for more
    programs an SM)."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    K = topk_ids.shape[-1]
    ids = topk_ids.reshape(-1)
    ng1, ng2 = D // 32, I // 32
    for c, ng in ((c1, ng1), (c2, ng2)):
        if "num_warps" in c or ng % 4:
            raise ValueError(
                f"MMA GEMV config {c}: WG sets the warps (no num_warps); K/32={ng} must be a multiple of 4"
            )
    x32 = x.view(torch.int32)
    k1 = _int4_mma_gemv1_kernel[(T * K * triton.cdiv(I, 8 * c1["MR"]),)](
        x32,
        w13,
        s13,
        hbuf,
        ids,
        I,
        ng1,
        x32.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1) // 4,
        hbuf.stride(0),
        expert_offset,
        E,
        TOPK=K,
        MR=c1["MR"],
        WG=c1["WG"],
        EVEN=ng1 % (4 * c1["WG"]) == 0 and I % (8 * c1["MR"]) == 0,
        PREFETCH=c1.get("PREFETCH", False),
        MUL=c1.get("MUL", False),
        NS=c1.get("NS", 1),
        num_warps=c1["WG"],
        num_stages=1,
        maxnreg=c1.get("maxnreg"),
        **pdl,
    )
    h32 = hbuf.view(torch.int32)
    nb = c2.get("NB", 1)
    if nb > 1 and ng2 > 4 * c2["WG"]:
        raise ValueError(f"MMA GEMV config {c2}: NB > 1 needs K/32={ng2} <= 4 WG (one trip)")
    k2 = _int4_mma_gemv2_kernel[(T * K * triton.cdiv(triton.cdiv(D, 16 * c2["MR"]), nb),)](
        h32,
        w2,
        s2,
        y,
        topk_weights.reshape(-1),
        ids,
        D,
        ng2,
        h32.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1) // 4,
        y.stride(0),
        expert_offset,
        E,
        MR=c2["MR"],
        WG=c2["WG"],
        NB=nb,
        EVEN=ng2 % (4 * c2["WG"]) == 0 and D % (16 * c2["MR"]) == 0,
        PREFETCH=c2.get("PREFETCH", False),
        MUL=c2.get("MUL", False),
        NS=c2.get("NS", 1),
        num_warps=c2["WG"],
        num_stages=1,
        maxnreg=c2.get("maxnreg"),
        **pdl,
    )
    check_layout(k1, c1["WG"])
    check_layout(k2, c2["WG"])
