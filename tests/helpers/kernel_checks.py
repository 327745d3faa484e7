"""Kernel-vs-reference checks shared by the interpreter tests (tiny, CPU) and the gpu tests (real sizes, CUDA).

Every check draws fresh random inputs, poisons the output buffer with NaN, runs the kernel and compares with the
fp32 torch reference: ||out - ref|| / ||ref|| below 1e-2 for bf16 and 1e-4 for fp32. Failures print where."""

from __future__ import annotations

import contextlib

import torch

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, tol: float | None = None):
    tol = TOL[dtype] if tol is None else tol
    out, ref = out.float(), ref.float()
    nan = torch.isnan(out)
    if nan.any():
        idx = nan.nonzero()[:8].tolist()
        raise AssertionError(
            f"{what}: {int(nan.sum())} of {out.numel()} outputs are NaN (unwritten?), first at "
            f"{idx}; shape {tuple(out.shape)}"
        )
    err = rel_err(out, ref)
    if not err < tol:
        diff = (out - ref).abs()
        worst = list(torch.unravel_index(diff.argmax(), diff.shape))
        w = tuple(int(i) for i in worst)
        raise AssertionError(
            f"{what}: relative error {err:.3e} >= {tol:.0e}; max |diff| {diff.max().item():.3e} at "
            f"{w} (out {out[w].item():.5g} ref {ref[w].item():.5g}); |ref| mean "
            f"{ref.abs().mean().item():.3e}; shape {tuple(out.shape)}"
        )
    return err


def nan_like(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@contextlib.contextmanager
def poisoned_empty():
    """Inside, torch.empty returns NaN-filled (float) or -1-filled (int) tensors: the poisoned output buffers of APIs
    that allocate their own outputs, so anything a kernel leaves unwritten shows."""
    orig = torch.empty

    def empty(*args, **kwargs):
        t = orig(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = orig


# ---------------------------------------------------------------------------------------------------------------
def make_paged(ctx_lens: list[int], page_size: int, D: int, dtype, device, extra_pages: int = 3):
    """A cache with the requests' pages scattered in random order: (kv_cache, page_table int32, seq_lens int32)."""
    n_pages = [-(-L // page_size) for L in ctx_lens]
    total = sum(n_pages) + extra_pages
    perm = torch.randperm(total, device=device).to(torch.int32)
    kv = torch.randn(total, page_size, D, device=device).to(dtype)
    table = torch.zeros(len(ctx_lens), max(max(n_pages), 1) + 1, dtype=torch.int32, device=device)
    o = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[o : o + n]
        o += n
    return kv, table, torch.tensor(ctx_lens, dtype=torch.int32, device=device)


def check_mla_decode(
    device,
    dtype,
    *,
    H: int,
    R: int,
    P: int,
    q_len: int,
    ctx_lens: list[int],
    page_size: int,
    num_splits=None,
    config=None,
    strided_out: bool = False,
    q_scale: float = 0.3,
):
    """The partial buffers mla_decode allocates are NaN-poisoned too."""
    from mlaserve.kernels.mla_decode import mla_decode
    from tests.helpers.kernel_refs import mla_decode_ref

    T = len(ctx_lens) * q_len
    kv, table, seq_lens = make_paged(ctx_lens, page_size, R + P, dtype, device)
    q = (q_scale * torch.randn(T, H, R + P, device=device)).to(dtype)
    scale = (R + P) ** -0.5
    if strided_out:  # a view into a wider buffer, as the model's o_lat may be
        out = nan_like((T, H, R + 16), dtype, device)[..., :R]
    else:
        out = nan_like((T, H, R), dtype, device)
    with poisoned_empty():
        mla_decode(q, kv, table, seq_lens, q_len, scale, out, num_splits=num_splits, config=config)
    ref = mla_decode_ref(q, kv, table, seq_lens, q_len, scale, R)
    what = (
        f"mla_decode H={H} R={R} P={P} q_len={q_len} ctx={ctx_lens[:4]}.. page={page_size} splits={num_splits} {dtype}"
    )
    return assert_close(out, ref, dtype, what)


def check_prefill(
    device,
    dtype,
    *,
    H: int,
    Dqk: int,
    Dv: int,
    q_lens: list[int],
    k_lens: list[int],
    config=None,
    strided_v: bool = True,
    impl: str = "triton",
):
    from mlaserve.kernels.prefill_attention import prefill_attention, prefill_attention_sdpa
    from tests.helpers.kernel_refs import prefill_attention_ref

    Tp, C = sum(q_lens), sum(k_lens)
    q = torch.randn(Tp, H, Dqk, device=device).to(dtype)
    k = torch.randn(C, H, Dqk, device=device).to(dtype)
    if strided_v:  # as the model's v = kv[..., N:], a view with row stride H * (N + V)
        v = torch.randn(C, H, 16 + Dv, device=device).to(dtype)[..., 16:]
    else:
        v = torch.randn(C, H, Dv, device=device).to(dtype)
    cu_q = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, device=device).cumsum(0).to(torch.int32)
    out = nan_like((Tp, H, Dv), dtype, device)
    scale = Dqk**-0.5
    fn = prefill_attention if impl == "triton" else prefill_attention_sdpa
    if impl == "triton":
        fn(q, k, v, cu_q, cu_k, scale, out, max(q_lens), config=config)
    else:
        fn(q, k, v, cu_q, cu_k, scale, out, max(q_lens))
    ref = prefill_attention_ref(q, k, v, cu_q, cu_k, scale)
    return assert_close(
        out, ref, dtype, f"prefill_attention[{impl}] H={H} Dqk={Dqk} Dv={Dv} q={q_lens[:4]}.. k={k_lens[:4]}.. {dtype}"
    )


def check_prefill_mla(
    device,
    dtype,
    *,
    H: int,
    N: int,
    P: int,
    Dv: int,
    q_lens: list[int],
    k_lens: list[int],
    config=None,
    rope_per_head: bool = False,
    R: int = 16,
):
    """The two-source form as the model calls it: k_nope and v strided views of one [C, H, N+Dv] projection,
    k_rope a view of the latent [C, R+P] shared by all heads (or, rope_per_head, a [C, H, P] view)."""
    from mlaserve.kernels.prefill_attention import prefill_attention_mla
    from tests.helpers.kernel_refs import prefill_attention_ref

    Tp, C = sum(q_lens), sum(k_lens)
    q = torch.randn(Tp, H, N + P, device=device).to(dtype)
    kv = torch.randn(C, H, N + Dv, device=device).to(dtype)
    k_nope, v = kv[..., :N], kv[..., N:]
    if rope_per_head:
        k_rope = torch.randn(C, H, 8 + P, device=device).to(dtype)[..., 8:]
        k_full = torch.cat([k_nope, k_rope], -1)
    else:
        k_rope = torch.randn(C, R + P, device=device).to(dtype)[:, R:]
        k_full = torch.cat([k_nope, k_rope[:, None].expand(C, H, P)], -1)
    cu_q = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, device=device).cumsum(0).to(torch.int32)
    out = nan_like((Tp, H, Dv), dtype, device)
    scale = (N + P) ** -0.5
    prefill_attention_mla(q, k_nope, k_rope, v, cu_q, cu_k, scale, out, max(q_lens), config=config)
    ref = prefill_attention_ref(q, k_full, v, cu_q, cu_k, scale)
    return assert_close(
        out,
        ref,
        dtype,
        f"prefill_attention_mla H={H} N={N} P={P} Dv={Dv} q={q_lens[:4]}.. k={k_lens[:4]}.. cfg={config} {dtype}",
    )


def check_fused_moe(
    device, dtype, *, T: int, D: int, I: int, E_total: int, E_local: int, offset: int, K: int, config=None
):
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref

    x = torch.randn(T, D, device=device).to(dtype)
    w13 = (torch.randn(E_local, 2 * I, D, device=device) / D**0.5).to(dtype)
    w2 = (torch.randn(E_local, D, I, device=device) / I**0.5).to(dtype)
    ids = (
        torch.stack([torch.randperm(E_total, device=device)[:K] for _ in range(T)])
        if T
        else torch.empty(0, K, dtype=torch.int64, device=device)
    )
    w = torch.rand(T, K, device=device, dtype=torch.float32) + 0.1
    out = fused_experts(x, w13, w2, w, ids, offset, config=config)
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids, offset)
    if T == 0:
        assert out.shape == (0, D)
        return 0.0
    owned = ((ids >= offset) & (ids < offset + E_local)).any(1)
    if not owned.all():  # tokens with no local expert must be exact zeros
        z = out[~owned].float()
        assert torch.all(z == 0), f"fused_moe: tokens without a local expert are not zero: {z.abs().max()}"
    return assert_close(
        out, ref, dtype, f"fused_moe T={T} D={D} I={I} E={E_local}/{E_total} off={offset} K={K} {dtype}"
    )


def decode_moe_inputs(device, *, T: int, D: int, I: int, E: int, K: int, S: int, dtype=torch.bfloat16):
    """A decode step's fused-MoE operands: x [T, D], w13 [E, 2I, D], w2 [E, D, I], weights / ids [T, K + S] (K
    distinct routed experts, then the S shared slots E.. with weight 1.0), and kw = dict(shared=(gate, up, down))
    when S > 0, as fused_experts takes them."""
    x = torch.randn(T, D, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * I, D, device=device) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, I, device=device) / I**0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(T)])
    w = torch.rand(T, K, device=device) + 0.1
    kw = {}
    if S:
        kw = dict(
            shared=tuple(
                (torch.randn(*s, device=device) / s[1] ** 0.5).to(dtype) for s in ((S * I, D), (S * I, D), (D, S * I))
            )
        )
        ids = torch.cat([ids, E + torch.arange(S, device=device).expand(T, S)], 1)
        w = torch.cat([w, torch.ones(T, S, device=device)], 1)
    return x, w13, w2, w, ids, kw


def moe_align_ref(topk_ids: torch.Tensor, E_local: int, offset: int, block_m: int, tail: bool = False) -> tuple:
    """The expected layout: each local expert's pairs in index order, padded with T*K to a multiple of block_m ->
    (rows, blocks). tail: an expert's pairs in half blocks, pairs of them its blocks, an odd last one in the tail
    list -> (rows, blocks, tail rows, tail blocks)."""
    flat, TK = topk_ids.reshape(-1).cpu(), topk_ids.numel()
    rows, blocks, rows_t, blocks_t = [], [], [], []
    h = block_m // 2
    for e in range(E_local):
        pairs = (flat == e + offset).nonzero().reshape(-1).tolist()
        n = -(-len(pairs) // (h if tail else block_m))
        if tail:
            main, n = pairs[: n // 2 * block_m], n // 2
            if len(main) < len(pairs):
                rows_t += pairs[len(main) :] + [TK] * (h - len(pairs) + len(main))
                blocks_t.append(e)
            pairs = main
        rows += pairs + [TK] * (n * block_m - len(pairs))
        blocks += [e] * n
    return (rows, blocks, rows_t, blocks_t) if tail else (rows, blocks)


def check_moe_align(device, *, T: int, K: int, E_total: int, E_local: int, offset: int, block_m: int, **kw):
    """moe_align against moe_align_ref: the layout is a stable sort, so it must match exactly."""
    from mlaserve.kernels.moe_align import moe_align

    S = kw.get("shared", 0)  # the last S slots: fused shared experts E_total - S .. E_total - 1 (E_local == E_total)
    ids = torch.stack([torch.randperm(E_total - S, device=device)[: K - S] for _ in range(T)])
    if T > 3:  # a skewed routing too: every token prefers the first experts
        ids[: T // 2] = torch.arange(K - S, device=device)
    ids = torch.cat([ids, torch.arange(E_total - S, E_total, device=device).expand(T, S)], 1)
    got = moe_align(ids, E_local, offset, block_m, **kw)
    want = moe_align_ref(ids, E_local, offset, block_m, kw.get("tail", False))
    for (sorted_ids, expert_ids, num_padded), rows, blocks in zip((got[:3], got[3:]), want[::2], want[1::2]):
        n = int(num_padded)
        assert n == len(rows), f"moe_align num_padded {n} != {len(rows)}"
        assert sorted_ids[:n].tolist() == rows, f"moe_align rows differ (T={T} K={K} E={E_local} bm={block_m} {kw})"
        nb = len(blocks)
        assert expert_ids[:nb].tolist() == blocks and (expert_ids[nb:] == -1).all(), "moe_align expert ids differ"
    assert len(got) == len(want) // 2 * 3


def _near_tie(
    choice: torch.Tensor, n_group: int, topk_group: int, K: int, eps: float = 1e-5, group_top: int = 2
) -> bool:
    """Does this token's selection hinge on two values closer than eps (float64)? Then fp32 rounding may pick
    either, and a different but equally scored choice is not a kernel bug. group_top: a group scores the sum of its
    top 2 (V3) or its max (V2)."""
    c = choice.double()
    E = c.shape[0]
    if n_group > 1 and topk_group < n_group:
        gs = c.view(n_group, E // n_group).topk(group_top, -1).values.sum(-1).sort(descending=True).values
        if gs[topk_group - 1] - gs[topk_group] < eps:
            return True
        keep = torch.zeros(n_group, dtype=torch.bool, device=c.device)
        keep[c.view(n_group, -1).topk(group_top, -1).values.sum(-1).topk(topk_group).indices] = True
        c = c.masked_fill(~keep.repeat_interleave(E // n_group), float("-inf"))
    top = c.sort(descending=True).values
    return bool(top[K - 1] - top[K] < eps)


def check_routing(
    device,
    *,
    T: int,
    E: int,
    n_group: int,
    topk_group: int,
    K: int,
    norm: bool = True,
    scaling: float = 2.5,
    num_shared: int = 0,
    shared_id0: int = 0,
    scoring_func: str = "sigmoid",
):
    """num_shared: the S extra columns (ids shared_id0 + s, weight exactly 1.0) after the routed K. scoring_func
    "softmax": DeepSeek-V2's routing (bias zeros) against layers.moe.route_softmax. Every buffer the kernel
    allocates starts poisoned."""
    from mlaserve.kernels.routing import route_noaux_tc_logits
    from mlaserve.layers.moe import route_noaux_tc, route_softmax

    softmax = scoring_func == "softmax"
    logits = (3 if softmax else 1) * torch.randn(T, E, device=device)
    bias = torch.zeros(E, device=device) if softmax else 0.1 * torch.randn(E, device=device)
    with poisoned_empty():
        w, ids = route_noaux_tc_logits(
            logits, bias, K, n_group, topk_group, norm, scaling, num_shared, shared_id0, scoring_func=scoring_func
        )
    if softmax:
        rw, rids = route_softmax(logits, K, n_group, topk_group, norm, scaling)
    else:
        rw, rids = route_noaux_tc(logits, bias, K, n_group, topk_group, norm, scaling)
    S = num_shared
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (T, K + S)
    assert not w.isnan().any() and (ids >= 0).all(), "routing left poisoned outputs unwritten"
    if S:
        want = torch.arange(shared_id0, shared_id0 + S, device=device).expand(T, S)
        assert torch.equal(ids[:, K:], want), f"shared ids {ids[:, K:].tolist()[:4]} want {want.tolist()[:4]}"
        assert torch.equal(w[:, K:], torch.ones(T, S, device=device)), f"shared weights {w[:, K:].tolist()[:4]}"
        w, ids = w[:, :K], ids[:, :K]
    ids_s, o = ids.sort(-1)  # compare as sets per token
    rids_s, ro = rids.sort(-1)
    bad = (ids_s != rids_s).any(-1).nonzero().reshape(-1).tolist()
    choice = logits.double().softmax(-1) if softmax else logits.sigmoid() + bias
    unexplained = [t for t in bad if not _near_tie(choice[t], n_group, topk_group, K, group_top=1 if softmax else 2)]
    if unexplained:
        t = unexplained[0]
        raise AssertionError(
            f"routing E={E} G={n_group}/{topk_group} K={K}: {len(unexplained)} of {T} tokens differ "
            f"(not near-ties); token {t}: kernel {ids_s[t].tolist()} ref {rids_s[t].tolist()}; "
            f"biased scores kernel {choice[t, ids_s[t]].tolist()} ref {choice[t, rids_s[t]].tolist()}"
        )
    same = torch.ones(T, dtype=torch.bool, device=device)
    same[bad] = False
    err = (w.gather(1, o) - rw.gather(1, ro))[same].abs().max().item() if same.any() else 0.0
    assert err < 1e-5 * max(1.0, scaling), f"routing weights differ by {err:.3e}"
    return err


def check_rope_store_kv(device, dtype, *, T: int, R: int, P: int, page_size: int, num_pages: int, norm: bool = False):
    """norm: the kv_a_layernorm fused into the store, against layers.norm.RMSNorm's torch form then the store.
    The fused norm must equal the unfused kernels bit for bit (greedy outputs must not move)."""
    from mlaserve.kernels.rope_kv import rope_store_kv
    from mlaserve.layers.norm import RMSNorm
    from tests.helpers.kernel_refs import rope_store_kv_ref

    cache = nan_like((num_pages, page_size, R + P), dtype, device)
    slots = torch.randperm(num_pages * page_size, device=device)[:T]
    slots[::3] = -1  # padding tokens: skipped
    kv_a = torch.randn(T, R + P, device=device).to(dtype)
    c_kv = torch.randn(T, R + 8, device=device).to(dtype)[:, 4 : 4 + R]  # strided view
    k_pe = kv_a[:, R:]  # row stride R + P, as in the model
    pos = torch.randint(0, 4096, (T,), device=device).float()
    freqs = pos[:, None] * (1e-4 ** (torch.arange(P // 2, device=device) / (P // 2)))
    cos, sin = freqs.cos() * 1.1, freqs.sin() * 1.1
    if norm:
        ln = RMSNorm(R, eps=1e-6, dtype=dtype).to(device)
        ln.weight.data.copy_(1 + 0.1 * torch.randn(R, device=device))
        h = c_kv.float()  # RMSNorm's torch form (the module itself takes the GPU kernel on CUDA)
        normed = ln.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        ref = rope_store_kv_ref(cache, slots, normed, k_pe, cos, sin)
        rope_store_kv(cache, slots, c_kv, k_pe, cos, sin, ln.weight, 1e-6)
        if device == "cuda":  # bit for bit against the unfused kernels
            unfused = cache.clone()
            rope_store_kv(unfused, slots, ln(c_kv), k_pe, cos, sin)
            assert torch.equal(unfused.view(-1, R + P)[slots[slots >= 0]], cache.view(-1, R + P)[slots[slots >= 0]]), (
                "fused kv norm differs from the unfused"
            )
    else:
        ref = rope_store_kv_ref(cache, slots, c_kv, k_pe, cos, sin)
        rope_store_kv(cache, slots, c_kv, k_pe, cos, sin)
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    flat, rflat = cache.view(-1, R + P), ref.view(-1, R + P)
    assert torch.isnan(flat[~written]).all(), "rope_store_kv wrote a slot it should have skipped"
    return assert_close(flat[written], rflat[written], dtype, f"rope_store_kv T={T} R={R} P={P} {dtype}")


def check_absorb_q_rope_store_kv(
    device,
    dtype,
    *,
    T: int,
    H: int,
    N: int,
    R: int,
    P: int,
    norm: bool,
    pad: bool,
    page_size: int = 16,
    num_pages: int = 4,
    V: int = 8,
):
    """head_gemv.absorb_q_rope_store_kv (one launch) against absorb_q_rope (Q, bit for bit) and rope_store_kv (the
    cache rows): q and kv_a column views of one projection output, Q and the cache NaN-poisoned, the last token a
    padding slot (-1) when pad. Without the norm the rows equal rope_store_kv's; with it they are checked to a
    tight tolerance against the torch form (layers.norm.RMSNorm, then the reference store): the fused program
    reduces the sum of squares with one warp, rope_store_kv with rms_norm's, which may round differently on a GPU
    (the interpreter sums alike, so there the rows are also compared bit for bit). Returns (Q, cache) for replays."""
    from mlaserve.kernels.head_gemv import absorb_q_rope, absorb_q_rope_store_kv
    from mlaserve.kernels.rope_kv import rope_store_kv
    from tests.helpers.kernel_refs import rope_store_kv_ref

    w_kc = (torch.randn(H * (N + V), R, device=device) / R**0.5).to(dtype).view(H, N + V, R)[:, :N]
    proj = torch.randn(T, H * (N + P) + R + P, device=device).to(dtype)  # [q | kv_a] of one GEMM
    q, kv_a = proj[:, : H * (N + P)].view(T, H, N + P), proj[:, H * (N + P) :]
    c_kv, k_pe = kv_a[:, :R], kv_a[:, R:]
    pos = torch.randint(0, 4096, (T,), device=device).float()
    freqs = pos[:, None] * (1e-4 ** (torch.arange(P // 2, device=device) / (P // 2)))
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.randperm(num_pages * page_size, device=device)[:T]
    if pad:
        slots[-1] = -1
    weight = (1 + 0.1 * torch.randn(R, device=device)).to(dtype) if norm else None
    Q = nan_like((T, H, R + P), dtype, device)
    cache = nan_like((num_pages, page_size, R + P), dtype, device)
    assert absorb_q_rope_store_kv(q, w_kc, cos, sin, Q, cache, slots, c_kv, k_pe, weight, 1e-6) is Q
    Q2, cache2 = nan_like(Q.shape, dtype, device), nan_like(cache.shape, dtype, device)
    absorb_q_rope(q, w_kc, cos, sin, Q2)
    rope_store_kv(cache2, slots, c_kv, k_pe, cos, sin, weight, 1e-6)
    what = f"absorb_q_rope_store_kv T={T} H={H} norm={norm} pad={pad} {dtype}"
    assert not Q.isnan().any() and torch.equal(Q, Q2), f"{what}: Q differs from absorb_q_rope"
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    flat, flat2 = cache.view(-1, R + P), cache2.view(-1, R + P)
    assert flat[~written].isnan().all(), f"{what}: wrote a slot it should have skipped"
    assert not flat[written].isnan().any(), f"{what}: a row left unwritten"
    if not norm or device == "cpu":
        assert torch.equal(flat[written], flat2[written]), f"{what}: rows differ from rope_store_kv"
    else:  # for the record (pytest -s): how often the one-warp sum rounds apart from rope_store_kv's
        n = int((flat[written] != flat2[written]).sum())
        print(f"{what}: {n} of {flat[written].numel()} cache values differ from rope_store_kv's")
    if norm:
        h = c_kv.float()
        normed = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        ref = rope_store_kv_ref(cache, slots, normed, k_pe, cos, sin).view(-1, R + P)
        # two units in the last place: a sum of squares summed in another order may move the normalised value
        # by one before the weight, and the product's rounding by one more (rope_store_kv's rows do the same)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(flat[written], ref[written], rtol=2 * eps, atol=eps, msg=what)
    return Q, cache


def check_rope_q(device, dtype, *, T: int, H: int, P: int, alias: bool, head_major: bool = False):
    """x = q[..., N:] (a strided view); out is x (in place, the prefill form) or a view of another buffer (the
    decode form's Q[..., R:]). head_major: x is a [H, T, P] buffer transposed (token stride < head stride)."""
    from mlaserve.kernels.rope_kv import rope_q
    from tests.helpers.kernel_refs import rope_q_ref

    if head_major:
        x = torch.randn(H, T, 16 + P, device=device).to(dtype)[..., 16:].transpose(0, 1)
    else:
        x = torch.randn(T, H, 16 + P, device=device).to(dtype)[..., 16:]
    pos = torch.randint(0, 4096, (T,), device=device).float()
    freqs = pos[:, None] * (1e-4 ** (torch.arange(P // 2, device=device) / (P // 2)))
    cos, sin = freqs.cos(), freqs.sin()
    ref = rope_q_ref(x, cos, sin)
    out = x if alias else nan_like((T, H, 8 + P), dtype, device)[..., 8:]
    rope_q(x, cos, sin, out)
    return assert_close(out, ref, dtype, f"rope_q T={T} H={H} P={P} alias={alias} {dtype}")


def cuda_graph(fn):
    """Capture fn() in a CUDA graph (after one warm-up call that compiles the kernels) and return the graph.
    Capture itself fails on any host sync inside fn, so this also proves fn is graph safe."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        result = fn()
    return g, result


def check_rope_neox(device, dtype, *, T: int, H: int, P: int, alias: bool):
    """rope_neox against layers.rotary_llama.apply_rope_neox: x a column view of a wider buffer (a fused q|k|v
    output's q|k), rotated in place (alias) or into a NaN-poisoned view of another buffer; the buffer's other
    columns must come back untouched."""
    from mlaserve.kernels.rope_kv import rope_neox
    from mlaserve.layers.rotary_llama import apply_rope_neox

    buf = torch.randn(T, H * P + 24, device=device).to(dtype)
    x = buf[:, 8 : 8 + H * P].view(T, H, P)
    before, ref_x = buf.clone(), x.clone()
    pos = torch.randint(0, 4096, (T,), device=device).float()
    freqs = pos[:, None] * (1e-4 ** (torch.arange(P // 2, device=device) / (P // 2)))
    cos, sin = freqs.cos(), freqs.sin()
    ref = apply_rope_neox(ref_x, cos, sin)
    out = x if alias else nan_like((T, H, P + 8), dtype, device)[..., 4 : 4 + P]
    rope_neox(x, cos, sin, out)
    what = f"rope_neox T={T} H={H} P={P} alias={alias} {dtype}"
    assert torch.equal(buf[:, :8], before[:, :8]) and torch.equal(buf[:, 8 + H * P :], before[:, 8 + H * P :]), what
    if not alias:
        assert torch.equal(x, ref_x), f"{what}: x changed"
    return assert_close(out, ref, dtype, what)


def check_rope_cos_sin(device, *, T: int, half: int, scale: float, pos_dtype=torch.int64, exact: bool = False):
    """rope_cos_sin against RotaryEmbedding's torch form (positions up to 2^20, YaRN-like frequencies); exact:
    bit-equal (compiled: tl.cos/tl.sin are CUDA's precise cosf/sinf, which torch's kernels call)."""
    from mlaserve.kernels.rope_kv import rope_cos_sin

    pos = torch.randint(0, 1 << 20, (T,), device=device).to(pos_dtype)
    inv_freq = (torch.rand(half, device=device) * 10.0 ** -torch.linspace(0, 6, half, device=device)).float()
    freqs = pos.float().unsqueeze(-1) * inv_freq
    ref_c, ref_s = freqs.cos() * scale, freqs.sin() * scale
    with poisoned_empty():
        c, s = rope_cos_sin(pos, inv_freq, scale)
    what = f"rope_cos_sin T={T} half={half} scale={scale} {pos_dtype}"
    assert c.shape == s.shape == (T, half) and c.dtype == s.dtype == torch.float32, what
    if exact:
        bad = (c != ref_c) | (s != ref_s)
        first = bad.nonzero()[0].tolist() if bad.any() else None
        assert not bad.any(), f"{what}: {int(bad.sum())} values differ from torch's, first at {first}"
    else:  # the interpreter's numpy cos/sin may round the last bit differently
        assert_close(c, ref_c, torch.float32, what, tol=1e-6)
        assert_close(s, ref_s, torch.float32, what, tol=1e-6)


def check_argmax(device, dtype, *, B: int, V: int):
    """argmax_rows against torch.argmax(-1) on fresh random rows, with planted cases: the row max repeated later
    and in another block (the first wins), a whole row of -inf, a NaN after the max (the NaN wins, as in torch),
    and rows whose max is in the last, partial block. The output starts poisoned (-1)."""
    from mlaserve.kernels.argmax import argmax_rows

    x = torch.randn(B, V, device=device).to(dtype)
    g = torch.Generator().manual_seed(B * 7919 + V)
    for b in range(B):
        kind = b % 5
        i = int(torch.randint(0, V, (1,), generator=g))
        j = int(torch.randint(0, V, (1,), generator=g))
        if kind == 1:  # ties: the same max at two places
            x[b, min(i, j)] = x[b, max(i, j)] = 9.0
        elif kind == 2:
            x[b] = float("-inf")
        elif kind == 3 and V > 1:
            x[b, min(i, j)] = 9.0
            x[b, max(i, j) if i != j else V - 1] = float("nan")
        elif kind == 4:
            x[b, V - 1] = 9.0
    with poisoned_empty():
        out = argmax_rows(x)
    ref = x.argmax(-1)
    assert out.dtype == torch.int64 and out.shape == (B,)
    bad = (out != ref).nonzero().flatten().tolist()
    assert not bad, (
        f"argmax_rows B={B} V={V} {dtype}: rows {bad[:8]} got {out[bad[:8]].tolist()} want {ref[bad[:8]].tolist()}"
    )
    # into given buffers: a device row and a pinned host row (the GPU writes it over the bus), both poisoned
    dev_out = torch.full((B,), -1, dtype=torch.int64, device=device)
    host = torch.full((B,), -1, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
    assert argmax_rows(x, out=dev_out, host=host) is dev_out
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dev_out, ref) and torch.equal(host, ref.cpu()), f"argmax_rows out/host B={B} V={V}"
    # with offsets (an EAGLE3 draft's d2t: i -> i + offsets[i]) into a strided column of a poisoned [B, 3] buffer
    offsets = torch.randint(0, 1000, (V,), generator=g).to(device)
    cols = torch.full((B, 3), -1, dtype=torch.int64, device=device)
    argmax_rows(x, out=cols[:, 1], offsets=offsets)
    assert torch.equal(cols[:, 1], ref + offsets[ref]), f"argmax_rows offsets B={B} V={V}"
    assert (cols[:, 0] == -1).all() and (cols[:, 2] == -1).all()
    # a ring row picked on the device at run time (as a CUDA graph does): only that row's first B values change
    ring = torch.full((3, B + 2), -1, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
    row = torch.tensor([2], dtype=torch.int32, device=device)
    argmax_rows(x, out=dev_out, host=ring, host_row=row)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    want = torch.full((3, B + 2), -1, dtype=torch.int64)
    want[2, :B] = ref.cpu()
    assert torch.equal(ring, want), f"argmax_rows ring row B={B} V={V}"


def check_race_sample(device, *, R: int, V: int):
    """race_sample against the reference (sampler.py: the sort-based filter, softmax, argmax(p / E)) on fresh random
    rows and noise: temperatures, top-k (1 and more), top-p, min-p and their mixes, flat rows whose top-k takes many
    rounds, rows with -inf logits (a processor's masks), and a row the kernel is not given (stays -1). The output
    starts poisoned (-1)."""
    from mlaserve.kernels.race_sample import race_sample
    from mlaserve.layers.sampler import SamplingRow, _filter
    from mlaserve.types import SamplingParams

    g = torch.Generator().manual_seed(R * 131 + V)
    scale = torch.tensor([0.5, 2.0, 6.0])[torch.arange(R) % 3][:, None]
    x = (torch.randn(R, V, generator=g) * scale).to(device)
    x[1::7, : V // 2] = float("-inf")
    if R > 4:
        x[4] = 0.01 * torch.randn(V, generator=g).to(device)  # nearly flat: top-k rejects round after round
    noise = torch.empty(R, V).exponential_(generator=g).to(device)
    choices = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.3, top_k=5),
        dict(temperature=0.5, min_p=0.1),
        dict(temperature=1.0, top_k=3),
        dict(temperature=0.9, top_p=0.5, min_p=0.05),
        dict(temperature=1.0, top_k=1),
        dict(temperature=2.0, top_k=50, min_p=0.02),
    ]
    params = [SamplingParams(**choices[i % len(choices)]) for i in range(R)]
    rows = list(range(R - 1))  # the last row is not sampled
    ps = [params[i] for i in rows]
    par = torch.tensor(
        [
            rows,
            rows,
            [1.0 / p.temperature for p in ps],
            [p.top_p for p in ps],
            [p.min_p for p in ps],
            [p.top_k if 0 < p.top_k < V else 0 for p in ps],
        ],
        dtype=torch.float32,
        device=device,
    )
    out = torch.full((R,), -1, dtype=torch.int64, device=device)
    race_sample(x, noise, par, out, min_p=True, check=True)
    probs = _filter(x[: R - 1].float(), [SamplingRow(p, None) for p in ps]).softmax(-1)
    ref = (probs / noise[: R - 1]).argmax(-1)
    assert int(out[R - 1]) == -1, "race_sample wrote a row it was not given"
    bad = (out[: R - 1] != ref).nonzero().flatten().tolist()
    assert not bad, f"race_sample R={R} V={V}: rows {bad[:8]} got {out[bad[:8]].tolist()} want {ref[bad[:8]].tolist()}"
    kept = probs.gather(1, out[: R - 1, None]).squeeze(1)
    assert (kept > 0).all(), "race_sample drew a token the filters drop"
    # temperature alone: no check pass
    tonly = par.clone()
    tonly[3], tonly[4], tonly[5] = 1.0, 0.0, 0.0
    out2 = torch.full((R,), -1, dtype=torch.int64, device=device)
    race_sample(x, noise, tonly, out2, min_p=False, check=False)
    plain = [SamplingRow(SamplingParams(temperature=p.temperature), None) for p in ps]
    ref2 = (_filter(x[: R - 1].float(), plain).softmax(-1) / noise[: R - 1]).argmax(-1)
    bad = (out2[: R - 1] != ref2).nonzero().flatten().tolist()
    assert not bad and int(out2[R - 1]) == -1, f"race_sample R={R} V={V}, temperature alone: rows {bad[:8]}"
    # rows with a NaN or an inf (a diverged model): the rounds end, on some token of the row
    bad_rows = x[:3].clone()
    bad_rows[0, V // 3] = float("nan")
    bad_rows[1, V // 2] = float("inf")
    bad_rows[2] = float("nan")
    out3 = torch.full((3,), -1, dtype=torch.int64, device=device)
    # top_p, min_p and top_k: the check pass and its rounds
    par3 = torch.tensor([[0, 1, 2], [0, 1, 2], [1.0] * 3, [0.9] * 3, [0.1] * 3, [2] * 3], device=device)
    race_sample(bad_rows, noise, par3, out3, min_p=True, check=True)
    assert ((out3 >= 0) & (out3 < V)).all(), out3.tolist()


def sampling_rows(device, greedy: bool = True, extra=()):
    """A mix of sampling rows for the race kernel's callers: greedy (if asked), temperature alone, top-p, top-k,
    min-p, top-k with top-p (the reference's row), seeded rows with their own generators on `device`; then
    `extra` params. Fresh generators each call, so two calls draw the same noise."""
    from mlaserve.layers.sampler import SamplingRow
    from mlaserve.types import SamplingParams

    ps = [SamplingParams(temperature=0)] if greedy else []
    ps += [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=20),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.8),  # both: the reference's row
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=0.6, top_p=0.5, min_p=0.05, seed=12),
        *extra,
    ]
    gens = {p.seed: torch.Generator(device=device).manual_seed(p.seed) for p in ps if p.seed is not None}
    return [SamplingRow(p, gens.get(p.seed)) for p in ps]
