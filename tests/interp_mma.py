"""The Triton interpreter cannot run inline PTX; this runs the few PTX instructions kernels/int4_mma.py uses, warp by
warp, and kernels/int4_gemm.py's dequantization (DEQ_BF2_ASM, element by element), so their kernels run (and are
checked against the torch reference) on CPU.

The lane model is the one int4_mma.py assumes and int4_mma.check_layout verifies on compiled kernels: an asm op
on a logical [R, V] tile runs once per (row r, 128 columns, lane l), on the 4 consecutive elements 4 l .. 4 l + 3
(pack 4); 32-bit operands are one register an element, 16-bit ones two elements a register (low half first).
mma.sync m16n8k16 (bf16 -> fp32) follows PTX's fragment layout: lane (g, t) = (l // 4, l % 4) holds A[g][2t, 2t+1],
A[g+8][2t, 2t+1], A[g][2t+8, 2t+9], A[g+8][2t+8, 2t+9]; B[2t, 2t+1][g], B[2t+8, 2t+9][g]; C/D[g][2t, 2t+1],
[g+8][2t, 2t+1]. Products are exact; sums are taken in fp64 and rounded to fp32.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np


def _bf16(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _mma(a, b, c):
    """a: 4 x [W, 32] uint32, b: 2 x [W, 32], c: 4 x [W, 32] (fp32 bits) -> d: 4 x [W, 32]."""
    W = a[0].shape[0]
    g, t = np.arange(32) // 4, np.arange(32) % 4
    A = np.zeros((W, 16, 16))
    B = np.zeros((W, 16, 8))
    C = np.zeros((W, 16, 8))
    for i, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        A[:, g + dr, 2 * t + dk] = _bf16(a[i] & 0xFFFF)
        A[:, g + dr, 2 * t + dk + 1] = _bf16(a[i] >> 16)
    for i, dk in enumerate((0, 8)):
        B[:, 2 * t + dk, g] = _bf16(b[i] & 0xFFFF)
        B[:, 2 * t + dk + 1, g] = _bf16(b[i] >> 16)
    for i, (dr, dc) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
        C[:, g + dr, 2 * t + dc] = c[i].view(np.float32)
    D = (A @ B + C).astype(np.float32)
    at = ((0, 0), (0, 1), (8, 0), (8, 1))
    return [np.ascontiguousarray(D[:, g + dr, 2 * t + dc]).view(np.uint32) for dr, dc in at]


def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of {b, a} (a bytes 0-3)."""
    both = (b.astype(np.uint64) << 32) | a.astype(np.uint64)
    out = np.zeros_like(a)
    for i in range(4):
        src = ((sel >> (4 * i)) & 7).astype(np.uint64)
        out |= (((both >> (8 * src)) & 0xFF) << (8 * i)).astype(np.uint32)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for bit in range(8):
        if lut >> bit & 1:
            x = a if bit & 4 else ~a
            y = b if bit & 2 else ~b
            z = c if bit & 1 else ~c
            out |= x & y & z
    return out


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp64 values exact in fp32 -> bf16 bits (round to nearest even), as uint32."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)


def _fma_bf16x2(a, b, c):
    """PTX fma.rn.bf16x2 on both halves; the exact a * b + c is rounded once (exact in fp32 for the operands used:
    small integers, and products of a 4-bit integer and a bf16 scale)."""
    out = np.zeros_like(a)
    for sh in (0, 16):
        f = [_bf16((v >> sh) & 0xFFFF) for v in (a, b, c)]
        out |= _to_bf16_bits(f[0] * f[1] + f[2]) << np.uint32(sh)
    return out


def run_ptx(asm: str, operands: list[np.ndarray], n_out: int) -> list[np.ndarray]:
    """Execute `asm` on operand registers ([W, 32] uint32 each, outputs first, their input values ignored)."""
    regs: dict[str, np.ndarray] = {}
    shape = operands[-1].shape

    def val(tok):
        tok = tok.strip()
        if tok.startswith("$"):
            return operands[int(tok[1:])]
        if tok.startswith("0f"):
            return np.full(shape, int(tok[2:], 16), np.uint32)
        if re.match(r"^-?(0x[0-9a-fA-F]+|\d+)$", tok):
            return np.full(shape, int(tok, 0) & 0xFFFFFFFF, np.uint32)
        return regs[tok]

    def put(tok, v):
        tok = tok.strip()
        if tok.startswith("$"):
            operands[int(tok[1:])] = v.astype(np.uint32)
        else:
            regs[tok] = v.astype(np.uint32)

    body = re.sub(r"//[^\n]*", "", asm).strip()
    body = body[body.index("{") + 1 : body.rindex("}")]  # the asm's own scope
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op.startswith("mma.sync"):
            groups = [g.split(",") for g in re.findall(r"\{([^}]*)\}", rest)]
            d = _mma([val(x) for x in groups[1]], [val(x) for x in groups[2]], [val(x) for x in groups[3]])
            for tok, v in zip(groups[0], d):
                put(tok, v)
            continue
        if op == "mov.b32" and rest.lstrip().startswith("{"):  # {lo, hi}, r: a register's two 16-bit halves
            lo, hi = re.match(r"\{([^}]*)\}", rest.strip()).group(1).split(",")
            v = val(rest[rest.index("}") + 1 :].strip(" ,"))
            put(lo, v & 0xFFFF)
            put(hi, v >> 16)
            continue
        args = [x.strip() for x in rest.split(",")]
        if op == "mov.u32" and args[1] == "%laneid":
            put(args[0], np.broadcast_to(np.arange(32, dtype=np.uint32), shape))
        elif op in ("mov.b32", "mov.f32"):
            put(args[0], val(args[1]))
        elif op == "shl.b32":
            put(args[0], val(args[1]) << np.uint32(int(args[2], 0)))
        elif op == "shr.u32":
            put(args[0], val(args[1]) >> np.uint32(int(args[2], 0)))
        elif op == "mad.lo.u32":
            put(args[0], val(args[1]) * val(args[2]) + val(args[3]))
        elif op == "mul.hi.u32":
            put(args[0], ((val(args[1]).astype(np.uint64) * val(args[2]).astype(np.uint64)) >> 32))
        elif op == "and.b32":
            put(args[0], val(args[1]) & val(args[2]))
        elif op == "lop3.b32":
            put(args[0], _lop3(val(args[1]), val(args[2]), val(args[3]), int(args[4], 0)))
        elif op == "prmt.b32":
            put(args[0], _prmt(val(args[1]), val(args[2]), val(args[3])))
        elif op == "fma.rn.bf16x2":
            put(args[0], _fma_bf16x2(val(args[1]), val(args[2]), val(args[3])))
        elif op == "fma.rn.f32":
            f = [val(x).view(np.float32).astype(np.float64) for x in args[1:]]
            put(args[0], (f[0] * f[1] + f[2]).astype(np.float32).view(np.uint32))
        else:
            raise NotImplementedError(f"interp_mma: PTX op {op!r}")
    return operands[:n_out]


def _to_regs(data: np.ndarray, bits: int) -> list[np.ndarray]:
    """Logical [R, V] (V % 128 == 0) -> registers [W, 32] of one asm call (W = R * V / 128 warps)."""
    R, V = data.shape
    x = np.ascontiguousarray(data).reshape(R * V // 128, 32, 4)
    if bits == 32:
        return [x[..., j].view(np.uint32) for j in range(4)]
    x = x.view(np.uint16).astype(np.uint32)
    return [x[..., 2 * i] | (x[..., 2 * i + 1] << 16) for i in range(2)]


class _Call:
    def __init__(self, handles):
        self.handles = handles

    def get_result(self, i):
        return self.handles[i]


@contextlib.contextmanager
def emulate_mma():
    """Inside, the interpreter runs int4_mma.py's and int4_gemm.py's inline asm (and only those) with run_ptx."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    orig = interp.InterpreterBuilder.create_inline_asm

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        if "int4_gemm:" in asm:  # elementwise: 32-bit inputs, 16-bit outputs, one register each
            shape = values[0].data.shape
            ins = [v.data.reshape(-1).view(np.uint32).copy() for v in values]
            res = run_ptx(asm, [np.zeros_like(ins[0]) for _ in types] + ins, len(types))
            handles = [interp.TensorHandle(r.astype(np.uint16).reshape(shape), tl.bfloat16) for r in res]
            return _Call(handles)
        if "int4_mma:" not in asm:
            return orig(self, asm, constraints, values, types, is_pure, pack)
        shape = values[0].data.shape
        ops = []
        outs = [str(t.scalar if hasattr(t, "scalar") else t) for t in types]
        for _ in outs:
            ops += [np.zeros((int(np.prod(shape)) // 128, 32), np.uint32)] * 4
        for v in values:
            ops += _to_regs(v.data.reshape(-1, shape[-1]), v.dtype.scalar.primitive_bitwidth)
        res = run_ptx(asm, ops, 4 * len(outs))
        handles = []
        for i, o in enumerate(outs):
            x = np.stack(res[4 * i : 4 * i + 4], -1).reshape(shape)
            dt = tl.float32 if o == "fp32" else tl.int32
            handles.append(interp.TensorHandle(x.view(np.float32 if o == "fp32" else np.int32), dt))

        return _Call(handles)

    interp.InterpreterBuilder.create_inline_asm = create_inline_asm
    try:
        yield
    finally:
        interp.InterpreterBuilder.create_inline_asm = orig
