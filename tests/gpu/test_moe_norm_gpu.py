"""The MoE's sum over top-k with the next add + RMSNorm fused in, compiled on CUDA: bit-equal to the sum kernel then
add_rms_norm at real shapes (outputs and the GEMMs' per-(token, k) rows NaN-poisoned, so a skipped expert or an
unwritten output shows), in the MoE layer (eager and CUDA graph) and in the whole model (logits and EAGLE3 aux).
Run:  PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_moe_norm_gpu.py"""

import functools
import random

import pytest
import torch

from tests.helpers import kernel_checks as kc

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_seed")]
BF = torch.bfloat16
EPS = 1e-6


def _rms_ref(s, w):
    h = s.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(s.dtype)


# (D, I, E_local, K, S): Moonlight at world 1 (2 shared experts); Kimi-K2.5 / DeepSeek-V3 widths at moe-TP 4
SHAPES = {"moonlight": (2048, 1408, 64, 6, 2), "kimi-tp4": (7168, 512, 384, 8, 1)}


@functools.cache
def _weights(shape: str):
    """w13, w2 and the shared (gate, up, down) for a shape, drawn once per session (Kimi's are 8.4 GB)."""
    D, I, E, K, S = SHAPES[shape]
    w13 = (torch.randn(E, 2 * I, D, device="cuda") / D**0.5).to(BF)
    w2 = (torch.randn(E, D, I, device="cuda") / I**0.5).to(BF)
    gu = (torch.randn(2 * S * I, D, device="cuda") / D**0.5).to(BF)
    return w13, w2, (gu[: S * I], gu[S * I :], (torch.randn(D, S * I, device="cuda") / (S * I) ** 0.5).to(BF))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("T", [1, 5, 64])
@pytest.mark.parametrize("mode", ["plain", "add", "shared", "add+shared"])
@pytest.mark.parametrize("ep", [False, True])
def test_fused_experts_norm_bit_equal(shape, T, mode, ep):
    """fused_experts(norm=...) == add_rms_norm(fused_experts(...)) bit for bit; ep: 8 more experts of another rank
    in the routing (their rows are never written: the sums must skip them)."""
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.rmsnorm import add_rms_norm

    D, I, E, K, S = SHAPES[shape]
    S = S if "shared" in mode else 0
    offset = 16 if ep else 0
    w13, w2, shared = _weights(shape)
    x = torch.randn(T, D, device="cuda").to(BF)
    raw = torch.stack([torch.randperm(E + (8 if ep else 0), device="cuda")[:K] for _ in range(T)])
    ids = torch.where(raw < E, raw, raw + S) + offset  # E + S ..: another rank's experts
    wts = torch.rand(T, K, device="cuda") + 0.1
    kw = {}
    if S:
        kw["shared"] = shared
        ids = torch.cat([ids, torch.arange(S, device="cuda").expand(T, S) + offset + E], 1)
        wts = torch.cat([wts, torch.ones(T, S, device="cuda")], 1)
    if "add" in mode:
        kw["add"] = torch.randn(T, D, device="cuda").to(BF)
    norm_w = (1 + 0.1 * torch.randn(D, device="cuda")).to(BF)
    residual = torch.randn(T, D, device="cuda").to(BF)
    with kc.poisoned_empty():
        out = fused_experts(x, w13, w2, wts, ids, offset, **kw)
        ref_normed, ref_s = add_rms_norm(out, residual, norm_w, EPS)
        normed, s = fused_experts(x, w13, w2, wts, ids, offset, norm=(norm_w, EPS, residual), **kw)
    what = f"{shape} T={T} {mode} ep={ep}"
    assert not out.isnan().any() and not normed.isnan().any() and not s.isnan().any(), what
    assert torch.equal(s, ref_s), f"{what}: residual sum differs, max {(s.float() - ref_s.float()).abs().max()}"
    assert torch.equal(normed, ref_normed), (
        f"{what}: normed differs, max {(normed.float() - ref_normed.float()).abs().max()}"
    )
    assert torch.equal(s, out + residual), what  # the spec: torch's add, and the norm's torch form
    kc.assert_close(normed, _rms_ref(s, norm_w), BF, what)


def _moonlight_layer():
    from mlaserve.config import ModelConfig
    from mlaserve.distributed.tp import RankInfo
    from mlaserve.layers.norm import RMSNorm
    from mlaserve.models.deepseek_v3 import DeepseekV3MoE
    from mlaserve.models.dummy_weights import init_dummy_weights
    from mlaserve.models.make_random import load_preset

    cfg = ModelConfig.from_hf(load_preset("moonlight-16b-a3b"))
    with torch.device("cuda"):
        layer = DeepseekV3MoE(cfg, RankInfo(), BF, "triton")
        norm = RMSNorm(cfg.hidden_size, EPS, dtype=BF)
    init_dummy_weights(layer, seed=random.randrange(1 << 30))
    norm.weight.data.normal_(1.0, 0.1)
    assert layer.fuse_norm and layer.fuse_shared == 2
    return layer, norm


def test_moe_layer_norm_fused_real():
    """DeepseekV3MoE(x, norm, residual) at Moonlight's shapes: fused == fuse_norm off == norm(layer(x), residual);
    T = 1, 5 with the shared experts fused into the GEMMs, 64 (above fuse_shared_max_tokens) with them added."""
    layer, norm = _moonlight_layer()
    for T in (1, 5, 64):
        x = torch.randn(T, 2048, device="cuda").to(BF)
        residual = torch.randn(T, 2048, device="cuda").to(BF)
        with kc.poisoned_empty():
            normed, s = layer(x, norm, residual)
        layer.fuse_norm = False
        with kc.poisoned_empty():
            want = layer(x, norm, residual)
            spec = norm(layer(x), residual)
        layer.fuse_norm = True
        assert not normed.isnan().any(), f"T={T}"
        assert torch.equal(s, want[1]) and torch.equal(normed, want[0]), f"T={T}: fused differs from unfused"
        assert torch.equal(s, spec[1]) and torch.equal(normed, spec[0]), f"T={T}"


def test_moe_layer_norm_fused_cuda_graph():
    """The fused layer captured in a CUDA graph (decode T=1, 4), replayed with new inputs == eager unfused."""
    layer, norm = _moonlight_layer()
    for T in (1, 4):
        x = torch.randn(T, 2048, device="cuda").to(BF)
        residual = torch.randn(T, 2048, device="cuda").to(BF)
        g, (normed, s) = kc.cuda_graph(lambda: layer(x, norm, residual))  # noqa: B023
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            residual.copy_(torch.randn_like(residual))
            normed.fill_(float("nan"))
            s.fill_(float("nan"))
            g.replay()
            layer.fuse_norm = False
            want = layer(x, norm, residual)
            layer.fuse_norm = True
            assert torch.equal(s, want[1]) and torch.equal(normed, want[0]), f"graph replay T={T}"


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("fuse_shared_max", [32, 0])
def test_model_fused_norm_equals_unfused_and_before(tiny_ckpt, dtype, fuse_shared_max):
    """The model (Triton attention and MoE): fused norm == fuse_norm off == the layer flow before the fusion,
    logits and aux streams (0: the embedding .. 3: the final pre-norm stream) bit for bit; both steps with the
    shared experts fused, or (threshold 0) added in the sum. The torch MoE never fuses and matches too."""
    from mlaserve.kernel_config import KernelConfig
    from tests.helpers.layer_flow_check import check_layer_flow, load_model

    kernels = KernelConfig(fuse_shared_max_tokens=fuse_shared_max)
    model = load_model(tiny_ckpt, "cuda", dtype, "triton", kernels=kernels)
    assert check_layer_flow(model, "cuda", "triton", aux_layer_ids=(0, 1, 2, 3)) == 4  # 2 MoE layers x 2 steps
    assert check_layer_flow(model, "cuda", "triton", aux_layer_ids=(2,)) == 4
    if fuse_shared_max:
        model = load_model(tiny_ckpt, "cuda", dtype, "torch", kernels=kernels)
        assert check_layer_flow(model, "cuda", "triton", aux_layer_ids=(0, 1, 2, 3)) == 0
