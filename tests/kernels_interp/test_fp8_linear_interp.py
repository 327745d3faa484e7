"""The FP8 block-scaled linear (kernels/fp8_linear.py) under the interpreter: activation quantization bit for bit,
the W8A16 GEMV and the tiled GEMM (W8A16 and W8A8, split K) against fp32 references, at sizes that leave partial
128-blocks in N and K, with strided x and NaN-poisoned caller views as outputs; the checks' errors. The fp8 MMAs
run here too (the interpreter widens e4m3 exactly); scaled_mm runs on the GPU only (tests/gpu)."""

import pytest
import torch

from tests.helpers import fp8_checks as fc

BF, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("M,K", [(1, 128), (5, 200), (19, 300), (3, 7)])
@pytest.mark.parametrize("dtype", [BF, F32])
def test_act_quant_bit_exact(kdev, M, K, dtype):
    fc.check_act_quant(kdev, dtype, M=M, K=K)


def test_act_quant_padded_rows(kdev):
    """Rows padded to a multiple of 4 (scaled_mm's operand): q = 0 there, scales column-major over the padded rows."""
    from mlaserve.kernels.fp8_quant import act_quant
    from mlaserve.kernels.fp8_reference import fp8_act_quant_ref
    from tests.helpers.kernel_checks import poisoned_empty

    x = torch.randn(5, 256, device=kdev).to(BF)
    with poisoned_empty():
        q, s = act_quant(x, row_align=4)
    assert q.shape == (8, 256) and s.shape == (8, 2) and s.stride() == (1, 8)
    assert torch.equal(q[5:].view(torch.uint8), torch.zeros(3, 256, dtype=torch.uint8, device=kdev))
    qr, sr = fp8_act_quant_ref(x)
    assert torch.equal(q[:5].view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s[:5], sr)
    assert not torch.isnan(s).any()


@pytest.mark.parametrize("dtype", [F32, BF])
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "N,K,cfg",
    [
        (300, 200, dict(BLOCK_N=8)),  # partial block row and column; one masked trip (the default 256 columns)
        (300, 200, dict(BLOCK_N=8, BLOCK_K=128)),  # no whole step: a last two trips, the second masked
        (576, 256, dict(BLOCK_N=32, BLOCK_K=128)),  # kv_a's rows (4.5 block rows); one step of two whole trips
        (256, 384, dict(BLOCK_N=4, BLOCK_K=128)),  # no masks: one step of two trips, then an odd last trip
        (130, 520, dict(BLOCK_N=16, BLOCK_K=128)),  # two steps, then a masked last trip; rows end mid-program
    ],
)
def test_gemv(kdev, dtype, M, N, K, cfg):
    fc.check_fp8_linear(kdev, dtype, M=M, N=N, K=K, config=dict(cfg, form="gemv"))


@pytest.mark.parametrize("a8", [False, True])
@pytest.mark.parametrize(
    "M,N,K,cfg",
    [
        (5, 300, 200, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1)),
        (20, 130, 700, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4)),  # 6 blocks over 4 splits: one empty
        (40, 64, 256, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, SPLIT_K=2, GROUP_M=2)),
    ],
)
def test_triton_gemm(kdev, a8, M, N, K, cfg):
    fc.check_fp8_linear(kdev, F32, M=M, N=N, K=K, config=dict(cfg, form="triton", a8=a8))


@pytest.mark.parametrize("a8", [False, True])
def test_triton_gemm_bf16_own_output(kdev, a8):
    cfg = dict(form="triton", a8=a8, BLOCK_M=16, BLOCK_N=64, SPLIT_K=2)
    fc.check_fp8_linear(kdev, BF, M=12, N=192, K=384, config=cfg, out_view=False)


def test_default_forms_and_empty(kdev, monkeypatch):
    """By row count: the GEMV up to kernels.fp8_gemv_max_rows, W8A8 above kernels.fp8_linear_a8_min_tokens rows
    (whatever the experts' edge), by scaled_mm above fp8_scaled_mm_min_rows rows or on a weight of
    fp8_scaled_mm_min_bytes, where it runs, else the Triton GEMM; the Triton GEMM's W8A16 below a raised edge and
    for fp32 x. M = 0 gives an empty result."""
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels import fp8_linear as fl
    from mlaserve.kernels.fp8_reference import make_fp8_weight

    w, s = make_fp8_weight(64, 256, device=kdev)
    g = KernelConfig.fp8_gemv_max_rows
    for M, want in [(1, "gemv"), (g, "gemv"), (g + 1, "triton"), (300, "triton")]:  # fp32 x: never W8A8
        assert fl.linear_form(torch.empty(M, 256, device=kdev), w, s) == (want, False)
    edge = KernelConfig.fp8_linear_a8_min_tokens
    assert fl.linear_form(torch.empty(edge, 256, dtype=BF, device=kdev), w, s) == ("gemv", False)
    above = torch.empty(edge + 1, 256, dtype=BF, device=kdev)
    assert fl.linear_form(above, w, s) == ("triton", True)  # a small weight at few rows: not scaled_mm
    assert fl.linear_form(above, w, s, kernels=KernelConfig(fp8_a8_min_tokens=1 << 30)) == ("triton", True)
    raised = KernelConfig(fp8_linear_a8_min_tokens=edge + 1)
    assert fl.linear_form(above, w, s, kernels=raised) == ("triton", False)
    one = KernelConfig(fp8_linear_a8_min_tokens=1)
    assert fl.linear_form(torch.empty(2, 256, dtype=BF, device=kdev), w, s, kernels=one) == ("triton", True)
    wide = KernelConfig(fp8_gemv_max_rows=4, fp8_linear_a8_min_tokens=4)
    assert fl.linear_form(torch.empty(4, 256, dtype=BF, device=kdev), w, s, kernels=wide) == ("gemv", False)
    monkeypatch.setattr(fl, "scaled_mm_serves", lambda *a: True)
    for min_bytes, want in ((64 * 256, "scaled_mm"), (64 * 256 + 1, "triton")):
        assert fl.linear_form(above, w, s, kernels=KernelConfig(fp8_scaled_mm_min_bytes=min_bytes)) == (want, True)
    rows = KernelConfig.fp8_scaled_mm_min_rows
    assert fl.linear_form(torch.empty(rows, 256, dtype=BF, device=kdev), w, s) == ("triton", True)
    assert fl.linear_form(torch.empty(rows + 1, 256, dtype=BF, device=kdev), w, s) == ("scaled_mm", True)
    monkeypatch.undo()
    assert fl.fp8_block_linear(torch.empty(0, 256, device=kdev), w, s).shape == (0, 64)
    fc.check_fp8_linear(kdev, F32, M=9, N=64, K=256, weight=(w, s), config=dict(BLOCK_N=32))  # default form


def test_checks_name_the_argument(kdev):
    from mlaserve.kernels.fp8_linear import fp8_block_linear
    from mlaserve.kernels.fp8_reference import make_fp8_weight

    w, s = make_fp8_weight(200, 300, device=kdev)
    x = torch.randn(2, 300, device=kdev)
    with pytest.raises(ValueError, match=r"x \(2, 299\) and weight \(200, 300\)"):
        fp8_block_linear(x[:, :299], w, s)
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        fp8_block_linear(x, w.float(), s)
    with pytest.raises(ValueError, match=r"weight_scale_inv must be fp32 \[2, 3\]"):
        fp8_block_linear(x, w, s[:1])
    with pytest.raises(ValueError, match=r"out must be \[2, 200\] torch.float32"):
        fp8_block_linear(x, w, s, torch.empty(2, 200, dtype=BF, device=kdev))
    with pytest.raises(ValueError, match="form 'gemv' serves up to 4 rows"):
        fp8_block_linear(torch.randn(5, 300, device=kdev), w, s, config=dict(form="gemv"))
    with pytest.raises(ValueError, match="is not one of"):
        fp8_block_linear(x, w, s, config=dict(form="cublas"))
    if kdev == "cpu":
        with pytest.raises(ValueError, match="form 'scaled_mm' needs sm_90"):
            fp8_block_linear(x, w, s, config=dict(form="scaled_mm"))
    with pytest.raises(ValueError, match=r"fp8_gemv config keys \['SPLIT_K'\]"):
        fp8_block_linear(x, w, s, config=dict(form="gemv", SPLIT_K=2))
    with pytest.raises(ValueError, match="BLOCK_K=96"):
        fp8_block_linear(torch.randn(20, 300, device=kdev), w, s, config=dict(form="triton", BLOCK_K=96))


@pytest.mark.parametrize("M,K,topk", [(7, 256, 3), (20, 200, 2)])
def test_act_quant_sorted_rows(kdev, M, K, topk):
    """The MoE's sorted rows (moe_align's order, padding ids among them): row m is the reference quantization of
    token sorted_ids[m] // topk (a padding id's: a zero row's), whatever the row's block; rows from num_padded on
    stay unset, and their ids (which moe_align may leave unwritten: here negative and huge) are never read, also
    where a program's rows straddle num_padded."""
    from mlaserve.kernels.fp8_quant import act_quant
    from mlaserve.kernels.fp8_reference import fp8_act_quant_ref
    from tests.helpers.kernel_checks import poisoned_empty

    g = torch.Generator().manual_seed(M)
    x = (torch.randn(M, K, generator=g) * 3).to(BF).to(kdev)
    x[1] = 0  # a zero token beside the padding rows' zero
    pad = M * topk + 5
    ids = torch.cat([torch.randperm(M * topk, generator=g), torch.full((9,), pad)])[
        torch.randperm(M * topk + 9, generator=g)
    ]
    P = ids.numel() + 40  # rows past num_padded: never written
    junk = torch.tensor([-(1 << 30), -1, -7, 1 << 30] * 10)  # what an unwritten id may hold
    sorted_ids = torch.cat([ids, junk]).to(torch.int32).to(kdev)
    num_padded = torch.tensor([ids.numel()], dtype=torch.int32, device=kdev)
    with poisoned_empty():
        q, s = act_quant(x, 128, sorted_pairs=(sorted_ids, num_padded, topk))
    assert q.shape == (P, K) and s.shape == (P, 2) and s.stride() == (1, P)
    src = torch.where(ids < M * topk, ids // topk, M).to(kdev)
    qr, sr = fp8_act_quant_ref(torch.cat([x, torch.zeros(1, K, dtype=BF, device=kdev)])[src])
    n = ids.numel()
    assert torch.equal(q[:n].view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s[:n], sr)
    assert s[n:].isnan().all() and q[n:].float().isnan().all()  # past num_padded: the poison, unwritten


@pytest.mark.parametrize("form", ["scaled_mm", "triton_a8", "gemv"])
def test_fp8_silu_mul_linear_equals_two_steps(kdev, monkeypatch, form):
    """down(silu(g) * u) with the product quantized where it is computed (fp8_silu_mul_linear) gives the bits of
    silu_mul then fp8_block_linear, in every form. Without sm_90's scaled_mm (CPU: the interpreter) scaled_mm is
    replaced by its definition, which checks the operand layouts cuBLASLt needs (rows a multiple of 4, column-major
    activation scales)."""
    import torch.nn.functional as F

    import mlaserve.kernels.fp8_linear as fl
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.fp8_reference import dequant_fp8_block, make_fp8_weight
    from mlaserve.kernels.silu_mul import silu_mul

    M = {"scaled_mm": 13, "triton_a8": 9, "gemv": 2}[form]
    K, N = 512, 144  # scaled_mm's blockwise form needs ceil(K/128) a multiple of 4
    if form == "scaled_mm" and not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):

        def scaled_mm(a, b, sa, ta, sb, tb, output_dtype):
            assert a.shape[0] % 4 == 0 and sa.shape == (a.shape[0], K // 128) and sa.stride() == (1, a.shape[0])
            x = a.float() * sa.repeat_interleave(128, dim=1)[:, : a.shape[1]]
            return (x @ dequant_fp8_block(b.t(), sb.t()).t()).to(output_dtype)

        monkeypatch.setattr(F, "scaled_mm", scaled_mm)
        monkeypatch.setattr(fl, "scaled_mm_serves", lambda *a: True)
    kernels = KernelConfig(fp8_linear_a8_min_tokens=4, fp8_scaled_mm_min_rows=10 if form == "scaled_mm" else 1 << 40)
    torch.manual_seed(M)
    w, s = make_fp8_weight(N, K, device=kdev)
    gu = torch.randn(M, 2 * K + 4, device=kdev).to(BF)
    gu[:, 2 * K :] = float("nan")
    g, u = gu[:, :K], gu[:, K : 2 * K]
    assert fl.linear_form(g, w, s, None, kernels) == (form.removesuffix("_a8"), form != "gemv")
    fused = fl.fp8_silu_mul_linear(g, u, w, s, kernels=kernels)
    two = fl.fp8_block_linear(silu_mul(g, u), w, s, kernels=kernels)
    assert fused.shape == (M, N) and not fused.isnan().any()
    assert torch.equal(fused, two)
