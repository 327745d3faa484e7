"""FP8 kernel-vs-reference checks shared by the interpreter tests (tiny, CPU) and the gpu tests (DeepSeek-V3 sizes).

As kernel_checks.py: fresh random inputs, NaN-poisoned outputs, the fp32 torch reference of fp8_reference.py;
||out - ref|| / ||ref|| below 1e-2 for bf16 and 1e-4 for fp32. W8A8 forms are held to the reference that quantizes
the activations the same way (the quantization itself is checked bit for bit)."""

from __future__ import annotations

import torch

from tests.helpers.kernel_checks import assert_close, nan_like, poisoned_empty


def strided_rows(M: int, K: int, dtype, device, scale: float = 1.0) -> torch.Tensor:
    """x [M, K] as a column view of a wider buffer (row stride K + 24), as the model's projections' slices are."""
    return (scale * torch.randn(M, K + 24, device=device)).to(dtype)[:, 24:]


def check_act_quant(device, dtype, *, M: int, K: int, strided: bool = True, zero_row: bool = True):
    """fp8_act_quant equals fp8_act_quant_ref bit for bit, with the scales column-major (scaled_mm's layout)."""
    from mlaserve.kernels.fp8_linear import fp8_act_quant, fp8_act_quant_ref

    x = strided_rows(M, K, dtype, device, 3.0) if strided else (3 * torch.randn(M, K, device=device)).to(dtype)
    if zero_row and M > 1:
        x[1] = 0  # an all-zero group: the amax floor, q = 0
    with poisoned_empty():
        q, s = fp8_act_quant(x)
    qr, sr = fp8_act_quant_ref(x)
    G = -(-K // 128)
    assert q.shape == (M, K) and q.dtype == torch.float8_e4m3fn, (q.shape, q.dtype)
    assert s.shape == (M, G) and s.dtype == torch.float32 and (M <= 1 or s.stride(0) == 1), (s.shape, s.stride())
    assert torch.equal(s, sr), f"fp8_act_quant M={M} K={K}: scales differ, max {(s - sr).abs().max().item():.3e}"
    diff = (q.view(torch.uint8) != qr.view(torch.uint8)).sum().item()
    assert diff == 0, f"fp8_act_quant M={M} K={K} {dtype}: {diff} of {q.numel()} e4m3 values differ"


def check_fp8_linear(
    device, dtype, *, M: int, N: int, K: int, config=None, strided: bool = True, out_view: bool = True, weight=None
):
    """fp8_block_linear against fp8_block_linear_ref (a8 as the form used quantizes x); out = a NaN-poisoned column
    view of a wider buffer (the caller-view case), or the function's own (poisoned) output."""
    from mlaserve.kernels.fp8_linear import fp8_block_linear, fp8_block_linear_ref, linear_form
    from mlaserve.kernels.fp8_reference import make_fp8_weight

    w, s = weight if weight is not None else make_fp8_weight(N, K, device=device)
    x = strided_rows(M, K, dtype, device) if strided else torch.randn(M, K, device=device).to(dtype)
    form, a8 = linear_form(x, w, s, config)
    with poisoned_empty():
        if out_view:
            out = nan_like((M, N + 40), dtype, device)[:, 40:]
            assert fp8_block_linear(x, w, s, out, config=config) is out
        else:
            out = fp8_block_linear(x, w, s, config=config)
    assert out.shape == (M, N) and out.dtype == dtype
    ref = fp8_block_linear_ref(x, w, s, a8=a8)
    return assert_close(out, ref, dtype, f"fp8_block_linear[{form} a8={a8}] M={M} N={N} K={K} {config} {dtype}")


def make_fp8_experts(device, *, E: int, D: int, I: int):
    """(w13 [E, 2I, D], w13_scale_inv, w2 [E, D, I], w2_scale_inv) as the checkpoints hold them."""
    from mlaserve.kernels.fp8_reference import make_fp8_weight

    w13, s13 = make_fp8_weight(2 * I, D, E, device=device, half_rows=I)
    w2, s2 = make_fp8_weight(D, I, E, device=device)
    return w13, s13, w2, s2


def moe_routing(device, *, T: int, K: int, E_total: int):
    """ids [T, K] (K distinct experts a token), weights [T, K] fp32 in [0.1, 1.1)."""
    ids = torch.rand(T, E_total, device=device).topk(K, -1).indices if T else torch.empty(0, K, device=device).long()
    return ids, torch.rand(T, K, device=device) + 0.1


def _e4m3_margin(a: torch.Tensor) -> torch.Tensor:
    """a >= 0 (fp64, at most 448) -> its distance to the nearest e4m3 rounding boundary (a midpoint between two
    codes; spacing 2^(e-3) in the binade [2^e, 2^(e+1)), 2^-9 below 2^-6)."""
    e = torch.floor(torch.log2(a.clamp_min(2.0**-6)))
    spacing = torch.exp2(e - 3)
    t = a / spacing
    return (t - torch.floor(t) - 0.5).abs() * spacing


def a8_h_stable(x, w13, s13, topk_ids, offset: int, E_local: int) -> bool:
    """The W8A8 MoE quantizes h = silu(gate) * up to e4m3 per (row, 128 channels). The kernel and the reference sum
    gate and up in different orders, so their h / s differ by fp32 rounding noise, and a value that close to a
    rounding boundary gets different codes (an output difference of ~1e-3, above the fp32 tolerance:
    fp8_reference.fp8_fused_experts_ref says why). Stable: every value at least 8x its noise (the fp32 value against
    the fp64 one of the same quantized operands) from the nearest boundary."""
    from mlaserve.kernels.fp8_reference import (
        AMAX_FLOOR,
        FP8_MAX,
        act_scale,
        dequant_fp8_block,
        fp8_act_dequant,
        fp8_act_quant_ref,
    )

    I = w13.shape[1] // 2
    G = -(-I // 128)
    xf = fp8_act_dequant(*fp8_act_quant_ref(x))
    local = topk_ids.long() - offset
    for e in torch.unique(local[(local >= 0) & (local < E_local)]).tolist():
        tok, _ = torch.where(local == e)
        w = dequant_fp8_block(w13[e], s13[e], half_rows=I)
        vs = []
        for dt in (torch.float32, torch.float64):
            gu = xf[tok].to(dt) @ w.to(dt).T
            h = torch.nn.functional.pad(torch.nn.functional.silu(gu[:, :I]) * gu[:, I:], (0, G * 128 - I))
            h = h.view(len(tok), G, 128)
            amax = h.abs().amax(-1, keepdim=True)
            s = act_scale(amax) if dt == torch.float32 else amax.clamp_min(AMAX_FLOOR) / FP8_MAX  # fp64: exact enough
            vs.append((h / s).double())
        noise = (vs[0] - vs[1]).abs()
        if not bool((_e4m3_margin(vs[1].abs()) > 8 * noise).all()):
            return False
    return True


def check_fp8_moe(
    device,
    dtype,
    *,
    T: int,
    D: int,
    I: int,
    E_total: int,
    E_local: int,
    offset: int,
    K: int,
    config=None,
    experts=None,
    add: bool = False,
):
    """fp8_fused_experts against fp8_fused_experts_ref (a8 as the form used), every buffer it allocates poisoned;
    tokens with no local expert must come out exactly zero (or exactly `add`)."""
    from mlaserve.kernels.fp8_moe import fp8_fused_experts, fp8_moe_config, moe_form
    from mlaserve.kernels.fp8_reference import fp8_fused_experts_ref

    w13, s13, w2, s2 = experts if experts is not None else make_fp8_experts(device, E=E_local, D=D, I=I)
    ids, w = moe_routing(device, T=T, K=K, E_total=E_total)
    shared = strided_rows(T, D, dtype, device) if add else None
    _, gemv, a8 = moe_form(T, K, E_local, config, dtype=dtype)
    for _ in range(20):  # fp32 W8A8: inputs whose h codes are stable (a8_h_stable), as a test picks stable seeds
        x = torch.randn(T, D, device=device).to(dtype)
        if not (a8 and dtype == torch.float32) or a8_h_stable(x, w13, s13, ids, offset, E_local):
            break
    with poisoned_empty():
        out = fp8_fused_experts(
            x, w13, s13, w2, s2, w, ids, offset, add=shared, all_local=E_local == E_total, config=config
        )
    assert out.shape == (T, D) and out.dtype == dtype
    if T == 0:
        return 0.0
    h16 = (
        a8
        and not gemv
        and fp8_moe_config(T, K, E_local, D, I, True, dtype, **moe_overrides(config))[0]["BLOCK_N"] < 128
    )
    ref = fp8_fused_experts_ref(x, w13, s13, w2, s2, w, ids, offset, a8=a8, h_dtype=dtype if h16 else None)
    owned = ((ids >= offset) & (ids < offset + E_local)).any(1)
    if not owned.all():
        z = out[~owned].float() - (0 if shared is None else shared[~owned].float())
        assert torch.all(z == 0), f"fp8_moe: tokens without a local expert are not exact: {z.abs().max()}"
    if shared is not None:
        ref = ref.to(dtype).float() + shared.float()  # the routed sum rounds to the dtype, then adds
    what = f"fp8_fused_experts[gemv={bool(gemv)} a8={a8}] T={T} D={D} I={I} E={E_local}/{E_total} off={offset} K={K}"
    return assert_close(out, ref, dtype, f"{what} {config} {dtype}")


def moe_overrides(config) -> dict:
    """fp8_fused_experts' config without its form keys: the fp8_moe_config overrides."""
    return {k: v for k, v in (config or {}).items() if k not in ("no_align", "gemv", "a8", "tma")}
