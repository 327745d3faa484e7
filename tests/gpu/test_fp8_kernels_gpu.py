"""The FP8 block-scaled kernels at DeepSeek-V3's shapes on CUDA: every form of fp8_block_linear (the GEMV, the Triton
GEMM as W8A16 and W8A8, torch's scaled_mm) and of fp8_fused_experts (the GEMV form, the grouped GEMMs as W8A16 and
W8A8, EP, the MoE-TP8 shard) against the fp32 references, plus CUDA-graph capture and replay with new inputs.
Run:  PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_fp8_kernels_gpu.py"""

import functools

import pytest
import torch

from tests.helpers import fp8_checks as fc
from tests.helpers import kernel_checks as kc

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_seed")]
BF = torch.bfloat16

# DeepSeek-V3 on one GPU: hidden 7168, q_lora 1536, kv_lora 512 + rope 64, 128 heads (q_b: 128 x 192 rows, kv_b:
# 128 x 256 rows, o_proj: 128 x 128 columns), dense intermediate 18432, experts' 2048 (the shared expert's too)
LINEARS = {
    "q_a|kv_a": (2112, 7168),
    "kv_a": (576, 7168),
    "q_b": (24576, 1536),
    "kv_b": (32768, 512),
    "o_proj": (7168, 16384),
    "dense_gate_up": (36864, 7168),
    "dense_down": (7168, 18432),
    "shared_down": (7168, 2048),
}


@functools.cache
def _weight(N: int, K: int):
    from mlaserve.kernels.fp8_reference import make_fp8_weight

    return make_fp8_weight(N, K, device="cuda")


@functools.cache
def _experts(E: int, D: int, I: int):
    return fc.make_fp8_experts("cuda", E=E, D=D, I=I)


def _scaled_mm_ok() -> bool:
    from mlaserve.kernels.fp8_linear import scaled_mm_serves

    w, s = _weight(576, 7168)
    return scaled_mm_serves(torch.empty(4, 7168, dtype=BF, device="cuda"), w, s)


# --- activation quantization ------------------------------------------------------------------------------------
@pytest.mark.parametrize("M,K", [(1, 7168), (7, 1536), (8192, 7168), (300, 576)])
def test_act_quant_bit_exact(M, K):
    fc.check_act_quant("cuda", BF, M=M, K=K)


# --- dense linears ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LINEARS))
@pytest.mark.parametrize("M", [1, 2, 8, 32, 256, 2048])
def test_linear_default_forms(name, M):
    N, K = LINEARS[name]
    fc.check_fp8_linear("cuda", BF, M=M, N=N, K=K, weight=_weight(N, K))


@pytest.mark.parametrize("name", ["q_a|kv_a", "kv_a", "o_proj"])
@pytest.mark.parametrize(
    "M,cfg",
    [
        (1, dict(form="gemv")),
        (3, dict(form="gemv", BLOCK_N=4, BLOCK_K=1024)),
        (4, dict(form="gemv")),
        (1, dict(form="gemv", BLOCK_N=16, BLOCK_K=512, num_warps=2)),
        (2, dict(form="gemv", BLOCK_N=4, BLOCK_K=2048, num_warps=8)),
        (2, dict(form="gemv", BLOCK_N=2, BLOCK_K=1024, num_warps=4)),
        (4, dict(form="triton", a8=False)),
        (32, dict(form="triton", a8=True)),
        (64, dict(form="triton", a8=False, SPLIT_K=1)),
        (256, dict(form="triton", a8=True)),
        (1000, dict(form="triton", a8=False)),
        (2048, dict(form="triton", a8=True)),
    ],
)
def test_linear_forced_forms(name, M, cfg):
    N, K = LINEARS[name]
    fc.check_fp8_linear("cuda", BF, M=M, N=N, K=K, config=cfg, weight=_weight(N, K))


@pytest.mark.parametrize("M", [4, 8, 1001, 8192])
@pytest.mark.parametrize("name", ["q_a|kv_a", "kv_a", "dense_down"])
def test_linear_scaled_mm(name, M):
    """torch's F.scaled_mm (BlockWise1x128 x BlockWise128x128) on the activation quantization: row counts that are
    and are not multiples of 4 (the padded rows), into a caller's column view (a copy) or its own output."""
    if not _scaled_mm_ok():
        pytest.skip("F.scaled_mm's blockwise scaling needs sm_90 and torch >= 2.10")
    N, K = LINEARS[name]
    for out_view in (True, False):
        fc.check_fp8_linear(
            "cuda", BF, M=M, N=N, K=K, config=dict(form="scaled_mm"), weight=_weight(N, K), out_view=out_view
        )


def test_linear_partial_blocks_and_fp32():
    """Shapes whose N and K end mid-block (a TP slice that is no 128 multiple is refused at load, but the kernels
    take any), and fp32 activations (IEEE dots)."""
    from mlaserve.kernels.fp8_reference import make_fp8_weight

    for N, K in ((1000, 700), (200, 7168), (4100, 1000)):
        w = make_fp8_weight(N, K, device="cuda")
        for M in (1, 5, 40, 600):
            fc.check_fp8_linear("cuda", BF, M=M, N=N, K=K, weight=w)
            fc.check_fp8_linear("cuda", torch.float32, M=M, N=N, K=K, weight=w)


@pytest.mark.parametrize("M,cfg", [(1, None), (2, None), (32, None), (512, None), (512, dict(form="triton", a8=True))])
def test_linear_cuda_graph_replay(M, cfg):
    """Captured once, replayed with new activations: the GEMV, the split-K Triton GEMM (its workspace and sum
    kernel), the W8A8 quantization + scaled_mm (or Triton) forms allocate nothing that depends on data."""
    from mlaserve.kernels.fp8_linear import fp8_block_linear, fp8_block_linear_ref, linear_form

    N, K = LINEARS["q_a|kv_a"]
    w, s = _weight(N, K)
    x = torch.randn(M, K, device="cuda").to(BF)
    out = torch.empty(M, N + 8, dtype=BF, device="cuda")[:, 8:]
    g, _ = kc.cuda_graph(lambda: fp8_block_linear(x, w, s, out, config=cfg))
    form, a8 = linear_form(x, w, s, cfg)
    for _ in range(2):
        x.copy_(torch.randn(M, K, device="cuda").to(BF))
        out.fill_(float("nan"))
        g.replay()
        kc.assert_close(out, fp8_block_linear_ref(x, w, s, a8=a8), BF, f"fp8 linear graph replay M={M} {form}")


# --- MoE ----------------------------------------------------------------------------------------------------------
DS_MOE = dict(D=7168, I=2048, E_total=256, E_local=256, offset=0, K=8)


@pytest.mark.parametrize("T", [1, 2, 4, 16, 64, 333, 1100, 2048, 8192])
def test_moe_deepseek(T):
    fc.check_fp8_moe("cuda", BF, T=T, **DS_MOE, experts=_experts(256, 7168, 2048))


@pytest.mark.parametrize(
    "T,cfg",
    [
        (1, dict(gemv=dict(gemv1=dict(BLOCK_N=2, BLOCK_K=512, num_warps=2), gemv2=dict(BLOCK_N=8, BLOCK_K=512)))),
        (2, dict(gemv=dict(gemv1=dict(BLOCK_N=4, BLOCK_K=512, num_warps=2), gemv2=dict(BLOCK_N=4, BLOCK_K=2048)))),
        (2, dict(gemv=False)),  # per-pair blocks, tiled W8A16
        (2, dict(gemv=False, a8=True)),
        (16, dict(a8=True)),
        (64, dict(a8=True)),
        (333, dict(a8=False)),
        (2048, dict(a8=False)),
        (2048, dict(a8=True, gemm2=dict(BLOCK_N=256, num_warps=8))),
        (2048, dict(a8=True, gemm1=dict(BLOCK_N=64, num_warps=4))),  # h in bf16, quantized after GEMM1
    ],
)
def test_moe_deepseek_forced_forms(T, cfg):
    fc.check_fp8_moe("cuda", BF, T=T, **DS_MOE, config=cfg, experts=_experts(256, 7168, 2048))


@pytest.mark.parametrize("T", [1, 2, 64, 2048])
def test_moe_fused_norm_bits(T):
    """norm=(weight, eps, residual) (the quantized MoE layer on one rank): the bits of the unfused output followed
    by add_rms_norm, the shared experts' output added."""
    from mlaserve.kernels.fp8_moe import fp8_fused_experts
    from mlaserve.kernels.rmsnorm import add_rms_norm

    w13, s13, w2, s2 = _experts(256, 7168, 2048)
    x = torch.randn(T, 7168, device="cuda").to(BF)
    ids, w = fc.moe_routing("cuda", T=T, K=8, E_total=256)
    add, residual = fc.strided_rows(T, 7168, BF, "cuda"), fc.strided_rows(T, 7168, BF, "cuda")
    nw = (1 + 0.1 * torch.randn(7168, device="cuda")).to(BF)
    with kc.poisoned_empty():
        out = fp8_fused_experts(x, w13, s13, w2, s2, w, ids, add=add)
        ref_normed, ref_s = add_rms_norm(out, residual, nw, 1e-6)
        normed, s = fp8_fused_experts(x, w13, s13, w2, s2, w, ids, add=add, norm=(nw, 1e-6, residual))
    assert torch.equal(s, ref_s) and torch.equal(normed, ref_normed)


@pytest.mark.parametrize("T", [1, 3, 200, 4096])
def test_moe_expert_parallel_and_add(T):
    """EP8's rank 2 (experts [64, 96) of 256): other experts contribute nothing, tokens with none of ours get
    exactly the shared experts' output; the sum reads the ids (all_local=False)."""
    cfg = dict(D=7168, I=2048, E_total=256, E_local=32, offset=64, K=8)
    fc.check_fp8_moe("cuda", BF, T=T, **cfg, experts=_experts(32, 7168, 2048), add=True)


@pytest.mark.parametrize("T", [1, 64, 2048])
def test_moe_tp8_shard_and_partial_blocks(T):
    """MoE TP8's shard (I = 256) and a shape with partial blocks in D and I (I = 176: w13's split scale rows)."""
    fc.check_fp8_moe(
        "cuda", BF, T=T, D=7168, I=256, E_total=256, E_local=256, offset=0, K=8, experts=_experts(256, 7168, 256)
    )
    fc.check_fp8_moe("cuda", BF, T=T, D=1000, I=176, E_total=16, E_local=16, offset=0, K=4)
    fc.check_fp8_moe("cuda", torch.float32, T=T, D=1000, I=176, E_total=16, E_local=16, offset=0, K=4)


@pytest.mark.parametrize("T,cfg", [(1, None), (2, None), (16, None), (512, None), (512, dict(a8=True))])
def test_moe_cuda_graph_replay_with_new_routing(T, cfg):
    from mlaserve.kernels.fp8_moe import fp8_fused_experts, moe_form
    from mlaserve.kernels.fp8_reference import fp8_fused_experts_ref

    w13, s13, w2, s2 = _experts(256, 7168, 2048)
    x = torch.randn(T, 7168, device="cuda").to(BF)
    ids = torch.zeros(T, 8, dtype=torch.int64, device="cuda")
    w = torch.ones(T, 8, device="cuda")
    g, out = kc.cuda_graph(lambda: fp8_fused_experts(x, w13, s13, w2, s2, w, ids, config=cfg))
    a8 = moe_form(T, 8, 256, cfg)[2]
    for _ in range(2):
        new_ids, new_w = fc.moe_routing("cuda", T=T, K=8, E_total=256)
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn(T, 7168, device="cuda").to(BF))
        g.replay()
        ref = fp8_fused_experts_ref(x, w13, s13, w2, s2, w, ids, a8=a8)
        kc.assert_close(out, ref, BF, f"fp8 moe graph replay T={T} {cfg}")


@pytest.mark.parametrize(
    "T,shape",
    [
        (333, dict(E=256, offset=0, E_total=256)),
        (8192, dict(E=256, offset=0, E_total=256)),
        (4096, dict(E=32, offset=64, E_total=256)),  # EP8's rank 2
        (2048, dict(E=256, offset=0, E_total=256, BLOCK_M=128, gemm2=dict(num_warps=8))),
        (8192, dict(E=256, offset=0, E_total=256, gemm1=dict(BLOCK_N=64, num_warps=4))),  # h in bf16
        (4096, dict(E=32, offset=64, E_total=256, gemm1=dict(BLOCK_N=32, num_warps=4))),
    ],
)
def test_moe_a8_tma_form_bits(T, shape):
    """The W8A8 GEMMs' TMA form (x quantized in the blocks' row order, whole tiles by TMA) gives the pointer
    form's bits: the same MMAs over the same K steps. Buffers poisoned."""
    from mlaserve.kernels.fp8_moe import fp8_fused_experts

    shape = dict(shape)
    E, offset, E_total = shape.pop("E"), shape.pop("offset"), shape.pop("E_total")
    w13, s13, w2, s2 = _experts(E, 7168, 2048)
    x = torch.randn(T, 7168, device="cuda").to(BF)
    ids, w = fc.moe_routing("cuda", T=T, K=8, E_total=E_total)
    outs = {}
    for tma in (False, True):
        with kc.poisoned_empty():
            outs[tma] = fp8_fused_experts(
                x, w13, s13, w2, s2, w, ids, offset, all_local=E == E_total, config=dict(shape, a8=True, tma=tma)
            )
    assert torch.equal(outs[True], outs[False]), f"T={T} {shape}: max diff {(outs[True] - outs[False]).abs().max()}"


def test_fp8_moe_eager_step_equals_its_graph_twin():
    """DeepSeek-V3's experts under EP4 (64 local of 256): an eager decode step of 33 requests planned as its graph of
    48 (plan_tokens) gives its rows bit for bit as the 48-row step does."""
    from mlaserve.kernels.fp8_moe import fp8_fused_experts

    w = fc.make_fp8_experts("cuda", E=64, D=7168, I=2048)
    ids, tw = fc.moe_routing("cuda", T=48, K=8, E_total=256)
    ids[33:], tw[33:] = ids[:15], tw[:15]
    x = torch.randn(48, 7168, device="cuda").to(torch.bfloat16)
    twin = fp8_fused_experts(x, *w, tw, ids, 64, all_local=False)
    step = fp8_fused_experts(x[:33], *w, tw[:33], ids[:33], 64, all_local=False, plan_tokens=48)
    assert torch.equal(step, twin[:33])
