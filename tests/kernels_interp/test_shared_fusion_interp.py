"""Shared-experts fusion under the interpreter: the routing's appended shared columns, fused_experts(shared=...)
against the references, and the MoE layer fused vs unfused (below / above the token threshold, S=1 and 2, moe-TP)."""

import pytest
import torch

from tests.helpers.kernel_checks import assert_close, check_routing, poisoned_empty


@pytest.mark.parametrize(
    "E,G,TG,K,S,id0",
    [(8, 2, 1, 2, 1, 8), (64, 1, 1, 6, 2, 64), (32, 8, 3, 5, 2, 40), (24, 4, 4, 3, 3, 0), (8, 2, 1, 2, 0, 0)],
)
def test_routing_appends_shared_columns(kdev, E, G, TG, K, S, id0):
    # the routed K against route_noaux_tc, then S columns of ids id0 + s with weight exactly 1.0 (not scaled);
    # outputs allocated poisoned (NaN / -1), so an unwritten column shows
    with poisoned_empty():
        check_routing(kdev, T=7, E=E, n_group=G, topk_group=TG, K=K, norm=K != 5, num_shared=S, shared_id0=id0)


def shared_mlp(x, gate, up, down):
    """The shared MLP as the unfused path computes it, in fp32: down(silu(gate x) * up x)."""
    x, gate, up, down = x.float(), gate.float(), up.float(), down.float()
    return torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ down.T


def slots(gate, up, down, S):
    """The shared MLP as S experts of I channels each (w13 [S, 2I, D] gate rows then up rows, w2 [S, D, I])."""
    I = gate.shape[0] // S
    w13 = torch.stack([torch.cat([gate[s * I : (s + 1) * I], up[s * I : (s + 1) * I]]) for s in range(S)])
    w2 = torch.stack([down[:, s * I : (s + 1) * I] for s in range(S)])
    return w13, w2


@pytest.mark.parametrize(
    "T,S,offset,no_align", [(1, 1, 0, True), (3, 2, 0, True), (9, 2, 0, False), (9, 1, 4, False), (20, 3, 0, False)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_shared_slots(kdev, dtype, T, S, offset, no_align):
    """fused_experts(shared=(gate, up, down)) with the routing's appended columns == routed + shared MLP, and ==
    fused_experts_ref over the routed experts plus the slots built by hand (the partition of the channels)."""
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref

    D, I, E, K = 32, 16, 6, 2
    x = torch.randn(T, D, device=kdev).to(dtype)
    w13 = (torch.randn(E, 2 * I, D, device=kdev) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, I, device=kdev) / I**0.5).to(dtype)
    gu = (torch.randn(2 * S * I, D, device=kdev) / D**0.5).to(dtype)  # stacked gate | up, as stack_rows keeps it
    gate, up = gu[: S * I], gu[S * I :]
    down = (torch.randn(D, S * I, device=kdev) / (S * I) ** 0.5).to(dtype)
    raw = torch.stack([torch.randperm(E + 2, device=kdev)[:K] for _ in range(T)])
    ids = torch.where(raw < E, raw, raw + S) + offset  # E + S and E + S + 1: owned by another EP rank
    w = torch.rand(T, K, device=kdev) + 0.1
    ids_all = torch.cat([ids, torch.arange(S, device=kdev).expand(T, S) + offset + E], 1)
    w_all = torch.cat([w, torch.ones(T, S, device=kdev)], 1)
    with poisoned_empty():
        out = fused_experts(
            x, w13, w2, w_all, ids_all, offset, shared=(gate, up, down), config=dict(no_align=no_align, BLOCK_M=16)
        )
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids, offset) + shared_mlp(x, gate, up, down)
    what = f"fused_experts shared T={T} S={S} offset={offset} no_align={no_align} {dtype}"
    assert_close(out, ref, dtype, what)
    s13, s2 = slots(gate.float(), up.float(), down.float(), S)
    by_slots = fused_experts_ref(
        x.float(), torch.cat([w13.float(), s13]), torch.cat([w2.float(), s2]), w_all, ids_all, offset
    )
    torch.testing.assert_close(by_slots, ref, rtol=1e-5, atol=1e-5)  # the slots sum to the shared MLP
    with pytest.raises(ValueError, match="shared"):
        fused_experts(x, w13, w2, w_all, ids_all, offset, shared=(gate, up, down[:, :-1]))


def moe_layer(S, dtype, impl, ranks=None, seed=0):
    from mlaserve.config import ModelConfig
    from mlaserve.distributed.tp import RankInfo
    from mlaserve.models.deepseek_v3 import DeepseekV3MoE
    from mlaserve.models.dummy_weights import init_dummy_weights
    from mlaserve.models.make_random import load_preset

    raw = dict(load_preset("tiny"), n_shared_experts=S)  # D=64, I=32, 8 experts, top-2 of 2 groups
    cfg = ModelConfig.from_hf(raw)
    layer = DeepseekV3MoE(cfg, ranks or RankInfo(), dtype, impl)
    init_dummy_weights(layer, seed=seed)
    return layer


def load_shard(dst, src) -> None:
    """dst (one rank's layer) reads its shard of every full weight of src (a world-1 layer) through the loaders."""
    full = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        p.weight_loader(p, full[name].detach())


@pytest.mark.parametrize("S", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_fused_equals_unfused(kdev, S, dtype):
    """The Triton MoE layer with the shared experts fused (T <= threshold) == without (T above it, or fusion off)
    == the torch path, on the same weights; the threshold lowered to 8 so both sides stay tiny (T=1: no align;
    8: aligned blocks; 9: above)."""
    from mlaserve.kernel_config import KernelConfig

    ref_layer = moe_layer(S, torch.float32, "torch").to(kdev)
    for p in ref_layer.parameters():  # weights and inputs exact in the dtype: only the arithmetic differs
        p.data = p.data.to(dtype).float()
    layer = moe_layer(S, dtype, "triton").to(kdev)
    layer.kernels = KernelConfig(fuse_shared_max_tokens=8)
    assert layer.fuse_shared == S
    load_shard(layer, ref_layer)
    for T in (1, 8, 9):
        x = torch.randn(T, 64, device=kdev).to(dtype).float()
        ref = ref_layer(x)
        with poisoned_empty():
            fused = layer(x.to(dtype))
        layer.fuse_shared = 0
        unfused = layer(x.to(dtype))
        layer.fuse_shared = S
        what = f"MoE layer T={T} S={S} {dtype}"
        assert_close(fused, ref, dtype, what + " vs torch")
        if T > 8 or dtype == torch.float32:  # above the threshold both runs take the same unfused path
            tol = 0 if T > 8 else 1e-5
            torch.testing.assert_close(fused, unfused, rtol=tol, atol=tol, msg=what)
        else:  # bf16: the shared output rounds per slot (fused) or once (unfused)
            assert_close(fused, unfused.float(), dtype, what + " fused vs unfused")


@pytest.mark.parametrize("S", [1, 2])
def test_moe_layer_fused_moe_tp_shards(kdev, S):
    """moe-TP 2: each rank's fused layer gives its partial (routed shard + shared shard, before the all-reduce);
    the partials sum to the full layer, and each equals that rank's unfused partial."""
    from mlaserve.distributed.tp import RankInfo

    ref_layer = moe_layer(S, torch.float32, "torch").to(kdev)
    x = torch.randn(3, 64, device=kdev)
    total = 0
    for rank in range(2):
        layer = moe_layer(S, torch.float32, "triton", RankInfo(rank=rank, world_size=2, moe_tp_size=2)).to(kdev)
        layer.reduce = False  # one process: the partial itself (tp.all_reduce is a no-op here anyway)
        assert layer.fuse_shared == S and layer.experts.down_proj.shape[-1] == 16
        load_shard(layer, ref_layer)
        part = layer(x)
        layer.fuse_shared = 0
        torch.testing.assert_close(part, layer(x), rtol=1e-5, atol=1e-5)
        total = total + part
    assert_close(total, ref_layer(x), torch.float32, f"moe-TP 2 fused partials S={S}")


def test_moe_layer_no_fusion_with_ep_or_torch(kdev):
    from mlaserve.distributed.tp import RankInfo

    assert moe_layer(1, torch.float32, "torch").fuse_shared == 0
    assert (
        moe_layer(2, torch.float32, "triton", RankInfo(rank=1, world_size=2, moe_tp_size=1, ep_size=2)).fuse_shared == 0
    )
    assert moe_layer(0, torch.float32, "triton").fuse_shared == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_logits_fused_equal_unfused(kdev, two_shared_ckpt, dtype):
    """A loaded random checkpoint: the model's logits with the shared experts fused == with today's unfused path
    (threshold 0), over prefill and decode steps (attention by the torch backend: only the MoE differs)."""
    from mlaserve.kernel_config import KernelConfig
    from tests.helpers.model_backend_check import run_model

    fused = run_model(two_shared_ckpt, kdev, dtype, "torch", "triton")
    unfused = run_model(two_shared_ckpt, kdev, dtype, "torch", "triton", kernels=KernelConfig(fuse_shared_max_tokens=0))
    for step, (a, b) in enumerate(zip(fused, unfused)):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        else:  # per-slot vs one rounding of the shared output; a near-tie expert choice may flip a row
            rows = (a - b).norm(dim=-1) / b.norm(dim=-1)
            assert rows.median() < 1e-2 and (rows > 5e-2).float().mean() <= 0.2, f"step {step}: {rows.tolist()}"
