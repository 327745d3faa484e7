"""Paged MLA decode attention in the absorbed form over the latent cache: split-KV, then a log-sum-exp combine.

Each program takes one request, a block of heads (times the q_len tokens of a verify block) and one split of
the context; the split's token range is computed in-kernel from seq_lens, so a captured CUDA graph stays valid
as lengths change. Every KV tile is loaded once per head block and serves both QK^T and PV (V = K[:, :R]).
One split kernel has both load paths, picked by its TMA constexpr. On Hopper the whole tiles come by TMA (tensor
descriptors): at 8k context, B=16, H=16 the split + combine took 49.9-50.2 us in three runs against 54.7-56.1 us
with cp.async pointer loads (H200, kernels_bench mla_sweep). The combine is a second kernel (mla_combine.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .mla_combine import COMBINE_TILE, _mla_decode_combine_kernel, _tiles_per_split
from .pdl import pdl_args, pdl_release, pdl_wait

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 32  # a split never takes fewer tokens than this (short contexts use fewer splits)
# (H200, batch 1, H=16: a 512 context in splits of >= 32 / 64 / 128 / 256 tokens 11.4 / 12.7 / 16.1 / 23.2 us)
MAX_SPLITS = 64
MAX_Q_LEN = 32  # tokens of a verify block
MAX_VERIFY_Q_LEN = 4  # blocks of 2 to this many tokens (a verify's K+1 <= 4) take 16-row programs (decode_config)
TMA_MIN_PROGRAMS = 4  # request x head-block programs below which pointer loads are the default (see mla_decode)
FEW_PROGRAMS = dict(BLOCK_N=16, MIN_SPLIT_TOKENS=16, num_stages=2)  # their tiles (see mla_decode)
FEW_MAX_SPLITS = 128  # and their split cap (default_num_splits)


@triton.jit
def _program_rows(
    SeqLens,
    H,
    num_splits,
    Q_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_QL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
):
    """A split program's rows (BLOCK_QL tokens x BLOCK_H heads), their causal limits and its token range: from the
    step inputs (SeqLens) only, so it may run before the PDL wait (pdl.py)."""
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_QL * BLOCK_H
    m = tl.arange(0, BLOCK_M)
    j = m // BLOCK_H  # token of the verify block
    h = hb * BLOCK_H + m % BLOCK_H
    row_ok = (j < Q_LEN) & (h < H)
    t = b * Q_LEN + j
    seq_len = tl.load(SeqLens + b)
    last_visible = seq_len - Q_LEN + j  # [M]: causal inside the verify block
    tiles_per_split = _tiles_per_split(seq_len, num_splits, BLOCK_N, MIN_SPLIT_TILES)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    return split, b, t, h, row_ok, last_visible, start, end


@triton.jit
def _program_q(Q, t, h, row_ok, stride_qt, stride_qh, R: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr):
    """The program's rows of q: (q_nope [M, R], q_pe [M, BLOCK_P]). Activations: after the PDL wait."""
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, BLOCK_P)
    q_row = Q + t.to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_r[None, :], mask=row_ok[:, None], other=0.0)  # [M, R]
    q_pe = tl.load(q_row + R + offs_p[None, :], mask=row_ok[:, None] & (offs_p < P)[None, :], other=0.0)  # [M, BP]
    return q_nope, q_pe


@triton.jit(do_not_specialize=["H", "num_splits"])  # varying batch sizes reuse one binary
def _mla_decode_split_kernel(
    Q,
    KV,
    KVn,
    KVp,
    PageTable,
    SeqLens,
    KvScale,
    Out,
    PartO,
    PartLse,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kvp,
    stride_kvs,
    stride_ptb,
    stride_ot,
    stride_oh,
    stride_or,
    H,
    num_splits,
    Q_LEN: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_QL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One split of one request's context for a block of rows. TMA=False: every tile by masked pointer loads
    (cp.async) through the page table; KVn / KVp are None. TMA=True (sm_90): whole KV tiles fetched by the
    tensor-memory accelerator, KVn / KVp being descriptors of the cache as [pages * PAGE_SIZE, R + P] rows with
    [BLOCK_N, R] / [BLOCK_N, P] boxes. A tile never straddles a page (PAGE_SIZE % BLOCK_N == 0, tiles aligned), so
    it is one box. The last, partial tile of a split uses masked loads instead: rows past the context may hold
    anything (stale or poisoned pages). The load paths are constexpr branches around whole loops (not a runtime
    `if`), so neither variant carries the other's code or registers. FP8: the cache is float8_e4m3fn with one
    scale (KvScale, 1 fp32): each tile is converted in registers to q's dtype (exact), and the scale, being one
    for the tensor, multiplies the scores' scale and the output instead of every element. With the scale 1.0 that
    is bit for bit the attention over attention.kv_fp8.dequantize_kv's rows; otherwise it skips their rounding to
    q's dtype."""
    # Before the PDL wait: the rows, the token range and the first page lookup read only the step's inputs
    # (SeqLens, PageTable: copied from the host before the forward, written by no kernel of the step; pdl.py).
    # The KV tiles may include this step's new rows (the store just wrote them): loaded after the wait.
    pdl_release(PDL)
    BLOCK_M: tl.constexpr = BLOCK_QL * BLOCK_H
    split, b, t, h, row_ok, last_visible, start, end = _program_rows(
        SeqLens, H, num_splits, Q_LEN, BLOCK_H, BLOCK_QL, BLOCK_N, MIN_SPLIT_TILES
    )
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, BLOCK_P)
    if FP8:  # one scale for the layer: q.(k s) = s (q.k) and p.(v s) = s (p.v), so it scales the scores and the output
        kv_scale = tl.load(KvScale)  # written by no kernel of the step: before the wait
        scale_log2 = scale_log2 * kv_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, R], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    pt = PageTable + b * stride_ptb
    if TMA:
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N  # whole tiles end here
        all_ok = offs_n >= 0
        page = tl.load(pt + start // PAGE_SIZE, mask=start < full_end, other=0)
        row = page * PAGE_SIZE + start % PAGE_SIZE  # the tile's first row; looked up one tile ahead
        pdl_wait(PDL)
        q_nope, q_pe = _program_q(Q, t, h, row_ok, stride_qt, stride_qh, R, P, BLOCK_P)
        for n0 in range(start, full_end, BLOCK_N):
            kv = KVn.load([row, 0])  # [N, R]
            k_pe = KVp.load([row, R])  # [N, P]
            if FP8:
                kv, k_pe = kv.to(Q.dtype.element_ty), k_pe.to(Q.dtype.element_ty)
            nxt = n0 + BLOCK_N
            page = tl.load(pt + nxt // PAGE_SIZE, mask=nxt < full_end, other=0)
            row = page * PAGE_SIZE + nxt % PAGE_SIZE
            m_i, l_i, acc = _attend_tile(
                q_nope, q_pe, kv, k_pe, n0 + offs_n, all_ok, last_visible, scale_log2, m_i, l_i, acc, DOT_PREC
            )
        # The last, partial tile: masked loads (rows past the context may hold anything, stale or poisoned pages).
        # A loop of 0 or 1 trips, not an `if`, so its loads are cp.async with zero fill straight into shared
        # memory: under an `if` they pass through registers and the kernel spills.
        for n0 in range(full_end, end, BLOCK_N):
            pos = n0 + offs_n
            pos_ok = pos < end
            pages = tl.load(pt + pos // PAGE_SIZE, mask=pos_ok, other=0)
            kv_row = KV + (pages.to(tl.int64) * stride_kvp + (pos % PAGE_SIZE) * stride_kvs)[:, None]
            kv_t = tl.load(kv_row + offs_r[None, :], mask=pos_ok[:, None], other=0.0)
            kpe_t = tl.load(kv_row + R + offs_p[None, :], mask=pos_ok[:, None] & (offs_p < P)[None, :], other=0.0)
            if FP8:
                kv_t, kpe_t = kv_t.to(Q.dtype.element_ty), kpe_t.to(Q.dtype.element_ty)
            m_i, l_i, acc = _attend_tile(
                q_nope, q_pe, kv_t, kpe_t, pos, pos_ok, last_visible, scale_log2, m_i, l_i, acc, DOT_PREC
            )
    else:
        # The page-table lookup runs one tile ahead (row_off is loop-carried), so the KV load's address never
        # waits on a load of the same iteration and Triton's pipeliner can multi-buffer the KV tiles.
        page = tl.load(pt + (start + offs_n) // PAGE_SIZE, mask=start + offs_n < end, other=0)
        row_off = page.to(tl.int64) * stride_kvp + ((start + offs_n) % PAGE_SIZE) * stride_kvs
        pdl_wait(PDL)
        q_nope, q_pe = _program_q(Q, t, h, row_ok, stride_qt, stride_qh, R, P, BLOCK_P)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            pos_ok = pos < end
            kv_row = KV + row_off[:, None]
            nxt = pos + BLOCK_N
            page = tl.load(pt + nxt // PAGE_SIZE, mask=nxt < end, other=0)
            row_off = page.to(tl.int64) * stride_kvp + (nxt % PAGE_SIZE) * stride_kvs
            kv = tl.load(kv_row + offs_r[None, :], mask=pos_ok[:, None], other=0.0)  # [N, R]: keys and values
            k_pe = tl.load(kv_row + R + offs_p[None, :], mask=pos_ok[:, None] & (offs_p < P)[None, :], other=0.0)
            if FP8:
                kv, k_pe = kv.to(Q.dtype.element_ty), k_pe.to(Q.dtype.element_ty)  # exact: e4m3 fits q's dtype
            m_i, l_i, acc = _attend_tile(
                q_nope, q_pe, kv, k_pe, pos, pos_ok, last_visible, scale_log2, m_i, l_i, acc, DOT_PREC
            )
    if FP8:
        acc = acc * kv_scale
    _finish(
        m_i,
        l_i,
        acc,
        t,
        h,
        row_ok,
        start < end,
        split,
        Out,
        PartO,
        PartLse,
        stride_ot,
        stride_oh,
        stride_or,
        H,
        num_splits,
        R,
        DIRECT,
    )


@triton.jit
def _attend_tile(q_nope, q_pe, kv, k_pe, pos, pos_ok, last_visible, scale_log2, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    """One KV tile of the online softmax: kv [N, R] serves as keys (with k_pe [N, P]) and as values."""
    s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PREC)
    s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PREC)
    visible = (pos[None, :] <= last_visible[:, None]) & pos_ok[None, :]
    s = tl.where(visible, s * scale_log2, float("-inf"))  # [M, N], log2 domain
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _finish(
    m_i,
    l_i,
    acc,
    t,
    h,
    row_ok,
    nonempty,
    split,
    Out,
    PartO,
    PartLse,
    stride_ot,
    stride_oh,
    stride_or,
    H,
    num_splits,
    R: tl.constexpr,
    DIRECT: tl.constexpr,
):
    offs_r = tl.arange(0, R)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:  # one split: write the output itself
        o_ptr = Out + t.to(tl.int64)[:, None] * stride_ot + h[:, None] * stride_oh + offs_r[None, :] * stride_or
        tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        # PartO [T, H, S, R] (fp32 unless configured) and PartLse [T, H, S] fp32, contiguous; empty splits write
        # only lse = -inf.
        th = t.to(tl.int64) * H + h
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(PartLse + th * num_splits + split, lse, mask=row_ok)
        po_ptr = PartO + (th * num_splits + split)[:, None] * R + offs_r[None, :]
        tl.store(po_ptr, o.to(PartO.dtype.element_ty), mask=row_ok[:, None] & nonempty)


@functools.cache
def _has_tma(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _use_tma(cfg: dict, kv_cache: torch.Tensor, P: int) -> bool:
    """Whole tiles by TMA (config TMA=True; Hopper and later, or the interpreter): needs a contiguous 16-bit or FP8
    cache whose pages hold whole tiles, and a rope part of >= 32 bytes a row (a box row's least)."""
    if not cfg.get("TMA", False):
        return False
    return (
        kv_cache.is_contiguous()
        and kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
        and P * kv_cache.element_size() >= 32
        and kv_cache.shape[1] % cfg["BLOCK_N"] == 0
    )


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decode_config(H: int, q_len: int, dtype: torch.dtype) -> dict:
    """Static tile sizes: the M dimension of a program is BLOCK_QL * BLOCK_H rows (tokens x heads), kept at
    16..32 so the fp32 accumulator [M, R] fits in registers (R=512: 64 regs/thread at M=32 with 8 warps), except
    that blocks of MAX_Q_LEN tokens (a short suffix's rows, engine/suffix.py) in 16 bits take two heads (M=64,
    128 regs/thread): a tile of the latent then serves twice the rows, and these programs are bound by their MMAs,
    not by the latent's bytes (`kernels_bench --only mla_q32`). Verify blocks of 2-4 tokens in 16 bits take M=16
    in 4 warps, as a decode row's 16 heads do: twice the programs of M=32, each with 4 warps, beat M=32 in 8 warps
    at every batch and context (`kernels_bench --only mla_verify`)."""
    fp32 = dtype == torch.float32
    block_ql = _pow2(q_len)
    rows = 32 if fp32 else 64 if block_ql == MAX_Q_LEN else 16 if 1 < block_ql <= MAX_VERIFY_Q_LEN else 32
    block_h = min(_pow2(H), max(1, rows // block_ql))
    block_h = max(block_h, 16 // block_ql)  # tl.dot needs M >= 16
    bm = block_ql * block_h
    # num_stages=3 gives two KV buffers (a tile in flight during compute; with 2 stages Triton 3.6 single-buffers
    # this loop). 36 KB per 32-token tile: 2 x 36 + 18 (Q) = 90 KB shared at M=16.
    return dict(
        BLOCK_H=block_h,
        BLOCK_QL=block_ql,
        BLOCK_N=16 if fp32 else 32,
        num_warps=4 if bm <= 16 else 8,
        num_stages=1 if fp32 else 3,
    )


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H100/H200; only the interpreter gets here


def default_num_splits(B: int, H: int, q_len: int, device: torch.device, dtype=torch.bfloat16) -> int:
    """Splits for two waves of programs over the SMs (132 on H200): two resident programs per SM hide each other's
    load latency (measured at 8k context, B=16, H=16: 16 splits 54.5 us, 8 splits 68 us, 32 splits 67 us); more
    only add partial-output traffic. Blocks of MAX_Q_LEN tokens, bound by their MMAs, take one wave: each
    program's longer run beats the second wave's overlap. Short contexts use fewer splits in-kernel (>=
    MIN_SPLIT_TOKENS each). Batch 1-3 (fewer than TMA_MIN_PROGRAMS programs) split up to FEW_MAX_SPLITS ways, with
    their short tiles (mla_decode)."""
    cfg = decode_config(H, q_len, dtype)
    programs = B * triton.cdiv(H, cfg["BLOCK_H"])
    waves = 1 if cfg["BLOCK_QL"] == MAX_Q_LEN else 2
    return max(1, min(FEW_MAX_SPLITS if _few(programs, dtype) else MAX_SPLITS, waves * num_sms(device) // programs))


def _few(programs: int, dtype: torch.dtype) -> bool:
    """Batch 1-3 (at 16 heads): fewer request x head-block programs than TMA_MIN_PROGRAMS, in a 16-bit dtype. They
    take pointer loads by default, FEW_PROGRAMS' tiles and up to FEW_MAX_SPLITS splits (mla_decode)."""
    return programs < TMA_MIN_PROGRAMS and dtype != torch.float32


def split_plan(
    B: int,
    H: int,
    q_len: int,
    dtype: torch.dtype,
    device: torch.device,
    num_splits: int | None = None,
    config: dict | None = None,
    use_tma: bool = False,
) -> tuple[int, dict, int]:
    """-> (splits, tiles, min_split_tiles) mla_decode launches a batch of B requests with: the split count (given,
    else default_num_splits from the batch), the tiles (decode_config, config's overrides; batch 1-3 without TMA
    FEW_PROGRAMS' unless config says FEW=False), and the least tiles a split takes. A context of seq_len tokens is
    cut into splits of max(cdiv(cdiv(seq_len, BLOCK_N), splits), min_split_tiles) tiles (mla_combine)."""
    config = dict(config or {})
    few = config.pop("FEW", None)
    cfg = dict(decode_config(H, q_len, dtype), **config)
    programs = B * triton.cdiv(H, cfg["BLOCK_H"])
    S = num_splits or default_num_splits(B, H, q_len, device, dtype)
    if (_few(programs, dtype) if few is None else few) and not use_tma:
        # batch 1-3 (latency bound): 16-token tiles and splits, 2 stages (one tile ahead), up to 128 splits; they
        # beat 32-token tiles with <= 64 splits at every context (`kernels_bench --only mla_sweep`).
        cfg = {**cfg, **FEW_PROGRAMS, **config}
    return S, cfg, max(1, cfg.get("MIN_SPLIT_TOKENS", MIN_SPLIT_TOKENS) // cfg["BLOCK_N"])  # both kernels cut alike


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
    config: dict | None = None,
    pdl: bool = True,
    kv_scale: torch.Tensor | None = None,
    plan_batch: int | None = None,
) -> torch.Tensor:
    """q [T, H, R+P], kv_cache [pages, page_size, R+P], page_table [B, max_pages] int32, seq_lens [B] int32
    (context including this step's q_len tokens), T = B * q_len -> out [T, H, R] (any strides).
    Token j of a request's block sees positions 0 .. seq_len - q_len + j. Rows with nothing visible get 0.
    A float8_e4m3fn cache (attention/kv_fp8.py) takes kv_scale (1 fp32 element, the layer's) and is read as its
    rows dequantized to q's dtype. config (benchmarks, tests, deterministic mode): tile overrides, MIN_SPLIT_TOKENS,
    TMA, FEW (the batch 1-3 tiles on or off; default by the program count): split_plan. plan_batch (default B): the
    batch the split count, tiles and load path are chosen for; a row's reduction order depends on those alone, so
    B requests planned as b >= B compute their rows bit for bit as a batch of b does (an eager step and its
    padded CUDA-graph twin: engine/runner.py)."""
    T, H, D = q.shape
    B = seq_lens.shape[0]
    R = out.shape[-1]
    P = D - R
    if q_len < 1 or q_len > MAX_Q_LEN:
        raise ValueError(f"q_len={q_len} must be in [1, {MAX_Q_LEN}]")
    if T != B * q_len:
        raise ValueError(f"q has {T} tokens; expected B * q_len = {B} * {q_len}")
    if out.shape != (T, H, R):
        raise ValueError(f"out shape {tuple(out.shape)} must be {(T, H, R)}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != D or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [pages, page_size, {D}] with unit last stride")
    if R < 16 or R & (R - 1) or P < 1 or P & (P - 1):
        raise ValueError(f"R={R} must be a power of two >= 16 and P={P} a power of two")
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if (not fp8 and q.dtype != kv_cache.dtype) or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"q dtype {q.dtype} and kv_cache dtype {kv_cache.dtype} must match (bf16/fp16/fp32), or the cache be "
            "float8_e4m3fn"
        )
    if fp8 != (kv_scale is not None):
        raise ValueError(f"kv_scale: a float8_e4m3fn cache needs one (fp32, 1 element), a {kv_cache.dtype} none")
    if fp8 and (kv_scale.numel() != 1 or kv_scale.dtype != torch.float32):
        raise ValueError(f"kv_scale must be 1 fp32 element, got {tuple(kv_scale.shape)} {kv_scale.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q must have unit stride in its last dim")
    if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int32 or page_table.shape[0] != B:
        raise ValueError("page_table [B, max_pages] and seq_lens [B] must be int32")
    page_size = kv_cache.shape[1]
    if page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two")
    config = dict(config or {})
    cfg = dict(decode_config(H, q_len, q.dtype), **{k: v for k, v in config.items() if k != "FEW"})
    # TMA pays a fixed cost per program (descriptor fetch, barriers): with few programs over short contexts (batch
    # 1 at 512 tokens: one-tile splits) pointer loads were faster in the engine, 6.0 vs 7.1 us per layer.
    if plan_batch is not None and plan_batch < B:
        raise ValueError(f"plan_batch={plan_batch} must be at least the batch's {B} requests")
    plan_b = plan_batch or B
    programs = plan_b * triton.cdiv(H, cfg["BLOCK_H"])
    cfg.setdefault("TMA", q.is_cuda and programs >= TMA_MIN_PROGRAMS and _has_tma(q.device.index))
    use_tma = _use_tma(cfg, kv_cache, P)
    S, tiles, min_split_tiles = split_plan(plan_b, H, q_len, q.dtype, q.device, num_splits, config, use_tma)
    cfg.update(tiles)
    if T == 0:
        return out
    grid = (triton.cdiv(H, cfg["BLOCK_H"]), S, B)
    if S > 1:
        # fp32 partials by default; PARTIAL_DTYPE (benchmarks) trades their bytes for one more rounding
        part_o = torch.empty(T, H, S, R, dtype=cfg.get("PARTIAL_DTYPE", torch.float32), device=q.device)
        part_lse = torch.empty(T, H, S, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    kv_n = kv_p = None  # None arguments are constexpr: the pointer variant has no descriptor parameters
    if use_tma:  # descriptors of the cache as rows [pages * page_size, R + P]: the [N, R] latent and [N, P] rope
        rows = kv_cache.view(-1, D)
        kv_n = TensorDescriptor.from_tensor(rows, [cfg["BLOCK_N"], R])
        kv_p = TensorDescriptor.from_tensor(rows, [cfg["BLOCK_N"], P])
    pdl = pdl_args(q, pdl)  # the split and combine kernels launch alike
    _mla_decode_split_kernel[grid](
        q,
        kv_cache,
        kv_n,
        kv_p,
        page_table,
        seq_lens,
        kv_scale if fp8 else seq_lens,  # never read without FP8
        out,
        part_o,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        H,
        S,
        Q_LEN=q_len,
        R=R,
        P=P,
        BLOCK_P=max(16, P),
        PAGE_SIZE=page_size,
        BLOCK_H=cfg["BLOCK_H"],
        BLOCK_QL=cfg["BLOCK_QL"],
        BLOCK_N=cfg["BLOCK_N"],
        DIRECT=S == 1,
        MIN_SPLIT_TILES=min_split_tiles,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        TMA=use_tma,
        FP8=fp8,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl,
    )
    if S > 1:
        block_s = _pow2(S)
        block_r = min(R, max(16, COMBINE_TILE // block_s))  # [S, BLOCK_R] fp32: <= 64 registers a thread
        _mla_decode_combine_kernel[(T, H, R // block_r)](
            part_o,
            part_lse,
            out,
            seq_lens,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            H,
            S,
            R=R,
            BLOCK_S=block_s,
            BLOCK_R=block_r,
            Q_LEN=q_len,
            BLOCK_N=cfg["BLOCK_N"],
            MIN_SPLIT_TILES=min_split_tiles,
            num_warps=4,
            **pdl,
        )
    return out
