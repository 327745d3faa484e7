"""The decode MoE's GEMV form (moe_gemv.py, fused_experts(config={"gemv": ...})) under the interpreter: against
fused_experts_ref plus the shared MLP, with the routing's shared columns, EP, K longer than one trip, a shared column
holding a routed id (the pre-wait guess is wrong and reloaded), and poisoned buffers."""

import pytest
import torch

from tests.helpers.kernel_checks import assert_close, poisoned_empty
from tests.kernels_interp.test_shared_fusion_interp import shared_mlp


def inputs(kdev, dtype, T, D, I, E, K, S, offset, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(kdev).to(dtype)

    x = rnd(T, D)
    w13, w2 = rnd(E, 2 * I, D, scale=D**-0.5), rnd(E, D, I, scale=I**-0.5)
    gu = rnd(2 * max(S, 1) * I, D, scale=D**-0.5)  # stacked gate | up, as stack_rows keeps them
    gate, up = gu[: max(S, 1) * I], gu[max(S, 1) * I :]
    down = rnd(D, max(S, 1) * I, scale=(max(S, 1) * I) ** -0.5)
    raw = torch.stack([torch.randperm(E + 2, generator=g)[:K] for _ in range(T)]).to(kdev)
    ids = torch.where(raw < E, raw, raw + S) + offset  # the last two: owned by another EP rank
    w = (torch.rand(T, K, generator=g) + 0.1).to(kdev)
    return x, w13, w2, gate, up, down, ids, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,S,offset", [(1, 2, 0), (2, 1, 0), (1, 0, 0), (2, 2, 4)])
def test_gemv_form_matches_reference(kdev, dtype, T, S, offset):
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref

    D, I, E, K = 32, 16, 6, 3
    x, w13, w2, gate, up, down, ids, w = inputs(kdev, dtype, T, D, I, E, K, S, offset)
    shared = (gate, up, down) if S else None
    ids_all = torch.cat([ids, torch.arange(S, device=kdev).expand(T, S) + offset + E], 1)
    w_all = torch.cat([w, torch.ones(T, S, device=kdev)], 1)
    with poisoned_empty():
        out = fused_experts(x, w13, w2, w_all, ids_all, offset, shared=shared, config=dict(gemv=True))
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids, offset)
    if S:
        ref = ref + shared_mlp(x, gate, up, down)
    assert_close(out, ref, dtype, f"moe gemv T={T} S={S} offset={offset} {dtype}")


@pytest.mark.parametrize(
    "cfg",
    [
        dict(gemv1=dict(BLOCK_K=16), gemv2=dict(BLOCK_K=8)),  # K in 3 / 3 trips
        dict(gemv1=dict(BLOCK_N=4), gemv2=dict(BLOCK_N=8)),
    ],
)  # rows per program
def test_gemv_form_trips_and_tiles(kdev, cfg):
    # D=40 and I=20 are not multiples of the trips or the row blocks: masked tails in both GEMVs
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref

    T, D, I, E, K, S = 2, 40, 20, 5, 2, 2
    x, w13, w2, gate, up, down, ids, w = inputs(kdev, torch.float32, T, D, I, E, K, S, 0, seed=1)
    ids_all = torch.cat([ids, torch.arange(S, device=kdev).expand(T, S) + E], 1)
    w_all = torch.cat([w, torch.ones(T, S, device=kdev)], 1)
    with poisoned_empty():
        out = fused_experts(x, w13, w2, w_all, ids_all, 0, shared=(gate, up, down), config=dict(gemv=cfg))
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids, 0) + shared_mlp(x, gate, up, down)
    assert_close(out, ref, torch.float32, f"moe gemv {cfg}")


def test_gemv_form_wrong_guess_reloads(kdev):
    # ids not in the routing's layout: a shared slot in a routed column and a routed expert in the last (shared)
    # column. The shared column's rows loaded before the wait are the wrong ones and must be replaced.
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref
    from tests.kernels_interp.test_shared_fusion_interp import slots

    T, D, I, E, S = 1, 32, 16, 4, 1
    x, w13, w2, gate, up, down, _, _ = inputs(kdev, torch.float32, T, D, I, E, 2, S, 0, seed=2)
    ids = torch.tensor([[E, 2]], device=kdev)  # the slot first, routed expert 2 where the slot's column is
    w = torch.tensor([[1.0, 0.7]], device=kdev)
    with poisoned_empty():
        out = fused_experts(x, w13, w2, w, ids, 0, shared=(gate, up, down), config=dict(gemv=True))
    s13, s2 = slots(gate, up, down, S)
    ref = fused_experts_ref(x, torch.cat([w13, s13]), torch.cat([w2, s2]), w, ids, 0)
    assert_close(out, ref, torch.float32, "moe gemv, guess wrong")


def test_gemv_form_norm_fused(kdev):
    # the add + RMSNorm after the MoE fused into the sum, as the engine runs it at batch 1
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.rmsnorm import add_rms_norm

    T, D, I, E, K, S = 1, 64, 32, 8, 2, 2
    x, w13, w2, gate, up, down, ids, w = inputs(kdev, torch.bfloat16, T, D, I, E, K, S, 0, seed=3)
    ids = ids.clamp(max=E - 1)
    ids_all = torch.cat([ids, torch.arange(S, device=kdev).expand(T, S) + E], 1)
    w_all = torch.cat([w, torch.ones(T, S, device=kdev)], 1)
    nw = (1 + 0.1 * torch.randn(D)).to(kdev).to(torch.bfloat16)
    residual = torch.randn(T, D).to(kdev).to(torch.bfloat16)
    sh = (gate, up, down)
    normed, summed = fused_experts(
        x, w13, w2, w_all, ids_all, 0, shared=sh, norm=(nw, 1e-6, residual), config=dict(gemv=True)
    )
    y = fused_experts(x, w13, w2, w_all, ids_all, 0, shared=sh, config=dict(gemv=True))
    ref_normed, ref_summed = add_rms_norm(y, residual, nw, 1e-6)
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, rtol=0, atol=0)


def test_gemv_form_needs_per_pair_blocks(kdev):
    from mlaserve.kernels.fused_moe import fused_experts

    T, D, I, E, K = 9, 32, 16, 6, 2
    x, w13, w2, _, _, _, ids, w = inputs(kdev, torch.float32, T, D, I, E, K, 0, 0)
    with pytest.raises(ValueError, match="per-pair"):
        fused_experts(x, w13, w2, w, ids.clamp(max=E - 1), 0, config=dict(gemv=True))


@pytest.mark.parametrize("I,cfg", [(20, {}), (20, dict(gemv2=dict(BLOCK_K=8))), (24, dict(gemv2=dict(BLOCK_N=8)))])
def test_gemv_form_ragged_rows(kdev, I, cfg):
    # rows that are not a power of two: one masked trip (I=20 in a 32-wide tile), or several with a masked last
    # (BLOCK_K=8: 8 + 8 + 4), with 4 or 8 rows a program
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref

    T, D, E, K, S = 2, 32, 5, 2, 2
    x, w13, w2, gate, up, down, ids, w = inputs(kdev, torch.float32, T, D, I, E, K, S, 0, seed=5)
    ids_all = torch.cat([ids, torch.arange(S, device=kdev).expand(T, S) + E], 1)
    w_all = torch.cat([w, torch.ones(T, S, device=kdev)], 1)
    with poisoned_empty():
        out = fused_experts(x, w13, w2, w_all, ids_all, 0, shared=(gate, up, down), config=dict(gemv=cfg or True))
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids, 0) + shared_mlp(x, gate, up, down)
    assert_close(out, ref, torch.float32, f"moe gemv I={I} {cfg}")


def test_gemv_env_forms():
    # MLASERVE_MOE_GEMV, read by KernelConfig.from_env: on by default; "0"; "n1:w1:n2:w2"
    pytest.importorskip("triton")
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels import fused_moe as fm

    want = {
        None: True,
        "0": False,
        "1": True,
        "1:2:8:4": {"gemv1": {"BLOCK_N": 1, "num_warps": 2}, "gemv2": {"BLOCK_N": 8, "num_warps": 4}},
    }
    for spec, parsed in want.items():
        kc = KernelConfig.from_env({} if spec is None else {"MLASERVE_MOE_GEMV": spec})
        assert kc.moe_gemv_config() == parsed, spec
        x = torch.zeros(1, 4)  # a CPU tensor: never the GEMV form by default, whatever the switch says
        assert fm._gemv_default(x, True, kc) is False
