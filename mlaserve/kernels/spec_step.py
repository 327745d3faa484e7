"""The speculative step's bookkeeping on the device, one launch each where torch takes four to eight small ones.

A greedy decode-only EAGLE3 step runs, besides the verify's and the draft's forwards (CUDA graphs): the shift of an
overlapped verify's positions by what the step before it accepted, the accepted counts, the draft graph's inputs,
and the next verify's input ids with the step's one read-back row. In torch each is a handful of tiny kernels, each
a launch on the host and a gap on the GPU. Each function here equals the torch code beside it in its caller
(ForwardBatch.shift_decode, verify_greedy, DraftGraphs.run_verified, SpecLoop), which the CPU runs.

Shapes: B requests, N = K + 1 verified tokens a request (the fed token and K drafts), q = N rows a request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_start


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    """t [B, n] with unit column stride (the kernels index rows by stride(0), columns by one); the engine's tensors
    have it already."""
    return t if t.stride(-1) == 1 else t.contiguous()


# Every runtime argument unspecialized (pointer alignment, ints equal to 1 or divisible by 16): one compile per set of
# constexprs, which the engine's warm-up makes (warm_up below).
@triton.jit(do_not_specialize=["Pos", "SeqLens", "Slots", "PageTable", "Shift", "stride_pt", "max_pages", "page_size"])
def _shift_decode_kernel(
    Pos,
    SeqLens,
    Slots,
    PageTable,
    Shift,
    stride_pt,
    max_pages,
    page_size,
    Q: tl.constexpr,
    QP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program b: request b's Q positions, its length and its Q KV slots moved on by Shift[b]; a request shifted by
    0 is left as it is (a padding row's slots stay -1)."""
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    s = tl.load(Shift + b)
    if s != 0:
        j = tl.arange(0, QP)
        ok = j < Q
        pos = tl.load(Pos + b * Q + j, mask=ok, other=0) + s
        tl.store(Pos + b * Q + j, pos, mask=ok)
        tl.store(SeqLens + b, (tl.load(SeqLens + b) + s).to(tl.int32))
        # the scheduler gave each request pages for these positions; the clamp only keeps a bad one inside the table
        page = tl.load(PageTable + b * stride_pt + tl.minimum(pos // page_size, max_pages - 1), mask=ok, other=0)
        tl.store(Slots + b * Q + j, page.to(tl.int64) * page_size + pos % page_size, mask=ok)


def shift_decode(
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_table: torch.Tensor,
    shift: torch.Tensor,
    q: int,
    page_size: int,
    pdl: bool = True,
) -> None:
    """In place, for the first n = len(shift) requests: positions[: n q] += shift (each request's q rows),
    seq_lens[:n] += shift, slot_mapping[: n q] = the page table's slot of each new position (of the requests whose
    shift is not 0: the others keep their slots). positions,
    slot_mapping int64, seq_lens int32, page_table int32 [>= n, max_pages], shift int64 [n]; all contiguous."""
    n = shift.shape[0]
    if n == 0:
        return
    _shift_decode_kernel[(n,)](
        positions,
        seq_lens,
        slot_mapping,
        page_table,
        shift,
        page_table.stride(0),
        page_table.shape[1],
        page_size,
        Q=q,
        QP=max(2, triton.next_power_of_2(q)),
        num_warps=1,
        **pdl_args(shift, pdl),
    )


@triton.jit(do_not_specialize=["Y", "Drafts", "Acc", "stride_y", "stride_d"])
def _accept_kernel(Y, Drafts, Acc, stride_y, stride_d, K: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    """Program b: Acc[b] = the length of the longest prefix of Drafts[b] equal to Y[b, :K]."""
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, KP)
    ok = j < K
    y = tl.load(Y + b * stride_y + j, mask=ok, other=0)
    d = tl.load(Drafts + b * stride_d + j, mask=ok, other=0).to(tl.int64)
    miss = ok & (d != y)
    tl.store(Acc + b, tl.min(tl.where(miss, j, K), 0).to(tl.int64))


def accept_greedy(y: torch.Tensor, drafts: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """y [B, N] int64 target tokens, drafts [B, K = N - 1] (any integer type) -> accepted counts [B] int64: as
    `(drafts == y[:, :-1]).int().cumprod(1).sum(1)`."""
    B, K = drafts.shape
    y, drafts = _unit_cols(y), _unit_cols(drafts)
    acc = torch.empty(B, dtype=torch.int64, device=y.device)
    if B:
        _accept_kernel[(B,)](
            y,
            drafts,
            acc,
            y.stride(0),
            drafts.stride(0),
            K=K,
            KP=max(2, triton.next_power_of_2(K)),
            num_warps=1,
            **pdl_args(y, pdl),
        )
    return acc


@triton.jit(do_not_specialize=["Y", "Acc", "Shift", "ExtIds", "AccIn", "Base", "n", "stride_y"])
def _draft_inputs_kernel(
    Y,
    Acc,
    Shift,
    ExtIds,
    AccIn,
    Base,
    n,
    stride_y,
    N: tl.constexpr,
    NP: tl.constexpr,
    SHIFT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program b: the draft graph's inputs for row b: its N tokens, its accepted count (0 on a padding row, so it
    takes row 0 of its own), and its first position moved on by Shift[b] (SHIFT)."""
    pdl_start(PDL)
    b = tl.program_id(0)
    if b < n:
        j = tl.arange(0, NP)
        ok = j < N
        tl.store(ExtIds + b.to(tl.int64) * N + j, tl.load(Y + b.to(tl.int64) * stride_y + j, mask=ok), mask=ok)
        tl.store(AccIn + b, tl.load(Acc + b).to(tl.int64))
        if SHIFT:
            tl.store(Base + b, tl.load(Base + b) + tl.load(Shift + b))
    else:
        tl.store(AccIn + b, 0)


def draft_inputs(
    y: torch.Tensor,
    acc: torch.Tensor,
    shift: torch.Tensor | None,
    ext_ids: torch.Tensor,
    acc_in: torch.Tensor,
    base: torch.Tensor,
    B: int,
    pdl: bool = True,
) -> None:
    """For n = len(y) <= B rows: ext_ids[: n N] = y (flattened), acc_in[:n] = acc, acc_in[n:B] = 0, and
    base[:n] += shift if given. y [n, N] int64, acc [n], shift [n] int64; ext_ids, acc_in, base int64."""
    n, N = y.shape
    y = _unit_cols(y)
    _draft_inputs_kernel[(B,)](
        y,
        acc,
        shift if shift is not None else acc,
        ext_ids,
        acc_in,
        base,
        n,
        y.stride(0),
        N=N,
        NP=max(2, triton.next_power_of_2(N)),
        SHIFT=shift is not None,
        num_warps=1,
        **pdl_args(y, pdl),
    )


_POS_ARGS = ["Base", "Acc", "PageTable", "ExtPos", "ExtSlots", "ExtSeq", "Rows", "DecPos", "DecSlots", "DecSeq"]


@triton.jit(do_not_specialize=_POS_ARGS + ["stride_pt", "stride_dec", "max_pages", "page_size"])
def _draft_positions_kernel(
    Base,
    Acc,
    PageTable,
    ExtPos,
    ExtSlots,
    ExtSeq,
    Rows,
    DecPos,
    DecSlots,
    DecSeq,
    stride_pt,
    stride_dec,
    max_pages,
    page_size,
    N: tl.constexpr,
    NP: tl.constexpr,
    K1: tl.constexpr,
    K1P: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program b: row b's extension over its N verified positions (from Base[b]; -1: a padding row, whose slots are
    -1), the row its draft token is taken from (b N + Acc[b]), and its K1 chained one-token steps' positions (from
    Base[b] + Acc[b] + 1), KV slots and lengths."""
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    base = tl.load(Base + b)
    acc = tl.load(Acc + b)
    live = base >= 0
    start = tl.maximum(base, 0)
    j = tl.arange(0, NP)
    ok = j < N
    q = start + j
    page = tl.load(PageTable + b * stride_pt + tl.minimum(q // page_size, max_pages - 1), mask=ok, other=0)
    tl.store(ExtPos + b * N + j, q, mask=ok)
    tl.store(ExtSlots + b * N + j, tl.where(live, page.to(tl.int64) * page_size + q % page_size, -1), mask=ok)
    tl.store(ExtSeq + b, (start + N).to(tl.int32))
    tl.store(Rows + b, b * N + acc)
    if K1 > 0:
        i = tl.arange(0, K1P)
        ok = i < K1
        q = start + acc + 1 + i
        page = tl.load(PageTable + b * stride_pt + tl.minimum(q // page_size, max_pages - 1), mask=ok, other=0)
        tl.store(DecPos + i * stride_dec + b, q, mask=ok)
        tl.store(
            DecSlots + i * stride_dec + b, tl.where(live, page.to(tl.int64) * page_size + q % page_size, -1), mask=ok
        )
        tl.store(DecSeq + i * stride_dec + b, (q + 1).to(tl.int32), mask=ok)


def draft_positions(
    base: torch.Tensor,
    acc: torch.Tensor,
    page_table: torch.Tensor,
    ext: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    dec: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    N: int,
    page_size: int,
    pdl: bool = True,
) -> None:
    """The draft step's positions for B = len(base) rows in one launch (DraftGraphs._prepare's torch code): ext =
    (positions [B N] int64, slots [B N] int64, lengths [B] int32) of the extension over each row's N verified
    positions, rows [B] int64 = b N + acc[b], and dec = (positions, slots, lengths) [K - 1, >= B] (int64, int64,
    int32, unit column stride) of the chained steps, or None (K = 1). base, acc [B] int64; page_table int32 [>= B,
    max_pages]."""
    B = base.shape[0]
    K1 = 0 if dec is None else dec[0].shape[0]
    dec_t = dec if dec is not None else ext
    _draft_positions_kernel[(B,)](
        base,
        acc,
        page_table,
        *ext,
        rows,
        *dec_t,
        page_table.stride(0),
        dec_t[0].stride(0),
        page_table.shape[1],
        page_size,
        N=N,
        NP=max(2, triton.next_power_of_2(N)),
        K1=K1,
        K1P=max(2, triton.next_power_of_2(max(K1, 1))),
        num_warps=1,
        **pdl_args(base, pdl),
    )


_PACK_ARGS = ["Y", "Acc", "Drafts", "Ids", "Rows", "Base", "Shift", "RingRow", "stride_y", "stride_d", "stride_r"]


@triton.jit(do_not_specialize=_PACK_ARGS)
def _pack_kernel(
    Y,
    Acc,
    Drafts,
    Ids,
    Rows,
    Base,
    Shift,
    RingRow,
    stride_y,
    stride_d,
    stride_r,
    N: tl.constexpr,
    K: tl.constexpr,
    NP: tl.constexpr,
    STEP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program b: Ids[b] = [Y[b, Acc[b]], Drafts[b]] and Rows[b] = [Y[b], Acc[b], Drafts[b]]. STEP (the step graph's
    outputs): Rows is row RingRow[0] of a ring whose rows are stride_r apart, and Shift[b] = Acc[b], or 0 where
    Base[b] < 0 (a padding row)."""
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    a = tl.load(Acc + b).to(tl.int64)
    y = tl.load(Y + b * stride_y + j, mask=j < N, other=0)
    d = tl.load(Drafts + b * stride_d + j, mask=j < K, other=0).to(tl.int64)
    W: tl.constexpr = N + 1 + K
    if STEP:
        Rows += tl.load(RingRow).to(tl.int64) * stride_r
        tl.store(Shift + b, tl.where(tl.load(Base + b) >= 0, a, 0))
    tl.store(Rows + b * W + j, y, mask=j < N)
    tl.store(Rows + b * W + N, a)
    tl.store(Rows + b * W + N + 1 + j, d, mask=j < K)
    tl.store(Ids + b * N + 1 + j, d, mask=j < K)
    tl.store(Ids + b * N, tl.load(Y + b * stride_y + a))


def _pack(y, acc, drafts, ids, rows, step: tuple | None, pdl: bool) -> None:
    """_pack_kernel over B = len(y) rows; step: (base, shift, ring_row) for the step graph's form (rows a ring)."""
    B, N = y.shape
    y, drafts = _unit_cols(y), _unit_cols(drafts)
    base, shift, ring_row = step if step is not None else (acc, acc, acc)  # read by the STEP form only
    if B:
        _pack_kernel[(B,)](
            y,
            acc,
            drafts,
            ids,
            rows,
            base,
            shift,
            ring_row,
            y.stride(0),
            drafts.stride(0),
            rows.stride(0) if step is not None else 0,
            N=N,
            K=drafts.shape[1],
            NP=max(2, triton.next_power_of_2(N)),
            STEP=step is not None,
            num_warps=1,
            **pdl_args(y, pdl),
        )


def pack_verified(
    y: torch.Tensor, acc: torch.Tensor, drafts: torch.Tensor, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """y [B, N] int64, acc [B], drafts [B, K] -> (the next verify's input ids [B, N] = [y[b, acc[b]], drafts[b]],
    the step's read-back rows [B, N + 1 + K] = [y, acc, drafts]), both int64 and fresh."""
    B, N = y.shape
    ids = torch.empty(B, N, dtype=torch.int64, device=y.device)
    rows = torch.empty(B, N + 1 + drafts.shape[1], dtype=torch.int64, device=y.device)
    _pack(y, acc, drafts, ids, rows, None, pdl)
    return ids, rows


def pack_step(
    y: torch.Tensor,
    acc: torch.Tensor,
    drafts: torch.Tensor,
    base: torch.Tensor,
    ids: torch.Tensor,
    shift: torch.Tensor,
    ring: torch.Tensor,
    ring_row: torch.Tensor,
    pdl: bool = True,
) -> None:
    """The step graph's outputs (engine/spec_graph.py), for B = len(y) rows: ids[: B N] = [y[b, acc[b]], drafts[b]]
    row by row (the next verify's input ids), shift[:B] = acc where base >= 0, else 0, and ring[r, : B (N + 1 + K)]
    = [y[b], acc[b], drafts[b]] row by row, r = ring_row[0] read when the kernel runs. y [B, N] int64, acc [B],
    drafts [B, K], base [B] int64; ids, shift int64; ring int64 [R, >= B (N + 1 + K)] (pinned host memory: written
    over the bus), ring_row int32 [1] on the device."""
    _pack(y, acc, drafts, ids, ring, (base, shift, ring_row), pdl)


def warm_up(N: int, page_size: int, device, pdl: bool = True) -> None:
    """Compile every kernel here for a verify of width N (the engine's warm-up: its kernels take no other
    specialization than their constexprs, so these are the variants serving runs)."""
    z = dict(dtype=torch.int64, device=device)
    y, base = torch.zeros(2, N, **z), torch.zeros(2, **z)
    acc = accept_greedy(y, y[:, 1:], pdl)
    for shift in (acc, None):
        draft_inputs(y, acc, shift, torch.zeros(2 * N, **z), torch.zeros(2, **z), base, 2, pdl)
    pack_verified(y, acc, y[:, 1:], pdl)
    table = torch.zeros(2, 4, dtype=torch.int32, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    ext = (torch.zeros(2 * N, **z), torch.zeros(2 * N, **z), torch.zeros(2, **i32))
    dec = (torch.zeros(N - 2, 2, **z), torch.zeros(N - 2, 2, **z), torch.zeros(N - 2, 2, **i32)) if N > 2 else None
    draft_positions(base, acc, table, ext, torch.zeros(2, **z), dec, N, page_size, pdl)
    shift_decode(
        torch.zeros(2 * N, **z),
        torch.zeros(2, dtype=torch.int32, device=device),
        torch.zeros(2 * N, **z),
        table,
        acc,
        N,
        page_size,
        pdl,
    )
