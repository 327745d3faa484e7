"""On a Hopper GPU, kernels launched with programmatic dependent launch (kernels/pdl.py) give bit for bit what they
give without it: a decoder-layer-shaped chain of the real kernels at Moonlight widths (GEMVs, the KV store with
RoPE, head GEMVs (at T=1 the query's with its RoPE in the same launch), query RoPE, MLA decode, add + RMSNorm,
router, routing, fused MoE with the next norm), eager and as replays of one CUDA graph, with every intermediate
freshly allocated NaN-poisoned; and the engine's greedy tokens. The chain includes kernels launched without PDL
(torch.bmm at T=8, the cuBLAS GEMMs, the poisoning fills).
Run:  PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_pdl_gpu.py"""

import pytest
import torch

from tests.helpers import kernel_checks as kc

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_seed")]
BF = torch.bfloat16
D, H, N, R, P, V, I, E, K, S = 2048, 16, 128, 512, 64, 128, 1408, 64, 6, 2  # Moonlight
LAYERS = 6


@pytest.fixture
def set_pdl(monkeypatch):
    """set_pdl(on): MLASERVE_PDL for the engines made next (EngineConfig reads KernelConfig.from_env)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")

    def set_(on: bool):
        monkeypatch.setenv("MLASERVE_PDL", "1" if on else "0")

    return set_


def _weights(T):
    from tests.helpers.kernel_checks import make_paged

    g = lambda *s, scale: (torch.randn(*s, device="cuda") * scale).to(BF)  # noqa: E731
    layers = [
        dict(
            wq=g(H * (N + P), D, scale=D**-0.5),
            wo=g(D, H * V, scale=(H * V) ** -0.5),
            wkv_b=g(H * (N + V), R, scale=R**-0.5).view(H, N + V, R),
            wkv=g(R + P, D, scale=D**-0.5),
            n1=1 + g(D, scale=0.1),
            n2=1 + g(D, scale=0.1),
            nkv=1 + g(R, scale=0.1),
            router=g(E, D, scale=D**-0.5),
            bias=torch.randn(E, device="cuda") * 0.1,
        )
        for _ in range(LAYERS)
    ]
    moe = (
        g(E, 2 * I, D, scale=D**-0.5),
        g(E, D, I, scale=I**-0.5),
        (g(S * I, D, scale=D**-0.5), g(S * I, D, scale=D**-0.5), g(D, S * I, scale=(S * I) ** -0.5)),
    )
    kv, table, lens = make_paged([700 + 37 * t for t in range(T)], 64, R + P, BF, "cuda")
    slots = torch.stack([table[t, (lens[t] - 1) // 64].long() * 64 + (lens[t] - 1) % 64 for t in range(T)])
    ang = torch.rand(T, P // 2, device="cuda") * 6.28
    return layers, moe, (kv, table, lens, slots, ang.cos(), ang.sin())


def _chain(x, res, layers, moe, attn, pdl: bool):
    """A decode step's kernels in a decode step's order, per layer, each launched with PDL or not."""
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.kernels.head_gemv import absorb_q_rope, head_gemv
    from mlaserve.kernels.mla_decode import mla_decode
    from mlaserve.kernels.rmsnorm import add_rms_norm
    from mlaserve.kernels.rope_kv import rope_q, rope_store_kv
    from mlaserve.kernels.routing import route_noaux_tc_logits, router_partials
    from mlaserve.layers.linear import linear

    kv, table, lens, slots, cos, sin = attn
    T = x.shape[0]
    w13, w2, shared = moe
    kernels = KernelConfig(pdl=pdl)
    for w in layers:  # as DeepseekV3Attention + DeepseekV3MoE run them (head GEMVs up to 2 tokens, then bmm)
        q = linear(x, w["wq"], kernels).view(T, H, N + P)  # the GEMV at T=1
        kv_a = linear(x, w["wkv"], kernels)
        rope_store_kv(kv, slots, kv_a[:, :R], kv_a[:, R:], cos, sin, norm_weight=w["nkv"], pdl=pdl)
        Q = torch.empty(T, H, R + P, device="cuda", dtype=BF)
        w_kc, w_vc = w["wkv_b"][:, :N], w["wkv_b"][:, N:].transpose(1, 2)
        if T <= 2:  # the absorption and the query's RoPE in one launch
            absorb_q_rope(q, w_kc, cos, sin, Q, pdl=pdl)
        else:
            torch.bmm(q[..., :N].transpose(0, 1), w_kc, out=Q[..., :R].transpose(0, 1))
            rope_q(q[..., N:], cos, sin, out=Q[..., R:], pdl=pdl)
        o = mla_decode(Q, kv, table, lens, 1, 192**-0.5, torch.empty(T, H, R, device="cuda", dtype=BF), pdl=pdl)
        out = torch.empty(T, H * V, device="cuda", dtype=BF)
        if T <= 2:
            head_gemv(o, w_vc, out.view(T, H, V), pdl=pdl)
        else:
            torch.bmm(o.transpose(0, 1), w_vc, out=out.view(T, H, V).transpose(0, 1))
        h = linear(out, w["wo"], kernels)  # the GEMV at T=1
        x, res = add_rms_norm(h, res, w["n1"], 1e-6, pdl=pdl)
        part = router_partials(x, w["router"], pdl=pdl)
        wts, ids = route_noaux_tc_logits(part, w["bias"], K, 1, 1, True, 2.446, num_shared=S, shared_id0=E, pdl=pdl)
        x, res = fused_experts(x, w13, w2, wts, ids, shared=shared, norm=(w["n2"], 1e-6, res), kernels=kernels)
    return x, res


@pytest.mark.parametrize("T", [1, 8])
def test_pdl_chain_bit_equal_eager_and_graph(set_pdl, T):
    layers, moe, attn = _weights(T)
    x0 = torch.randn(T, D, device="cuda").to(BF)
    r0 = torch.randn(T, D, device="cuda").to(BF)
    kv0 = attn[0].clone()

    def run(pdl: bool):
        attn[0].copy_(kv0)
        with kc.poisoned_empty():
            return _chain(x0, r0, layers, moe, attn, pdl)

    ref = run(False)
    assert not ref[0].isnan().any() and not ref[1].isnan().any()
    from mlaserve.kernels.pdl import pdl_args

    assert pdl_args(x0, True)["PDL"]
    eager = run(True)
    assert torch.equal(eager[0], ref[0]) and torch.equal(eager[1], ref[1])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        with kc.poisoned_empty():  # capture-time fills are graph nodes: every replay re-poisons its intermediates
            out = _chain(x0, r0, layers, moe, attn, True)
    for i in range(20):
        attn[0].copy_(kv0)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), f"replay {i}"


def test_pdl_off_by_env(set_pdl):
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.pdl import pdl_args

    x = torch.zeros(1, device="cuda")
    set_pdl(False)
    assert pdl_args(x, KernelConfig.from_env().pdl) == dict(PDL=False, launch_pdl=False)
    set_pdl(True)
    assert pdl_args(x, KernelConfig.from_env().pdl) == dict(PDL=True, launch_pdl=True)
    assert pdl_args(x.cpu(), True)["PDL"] is False


def test_pdl_on_under_tensor_parallelism(set_pdl):
    """TP ranks launch with PDL too (kernels/pdl.py says why it is safe around collectives): rank 0 reads the switch
    once and every rank's runner gets that config (EngineConfig.kernels, pickled to the ranks, with no narrowing by
    world size); MLASERVE_PDL=0 still turns it off everywhere."""
    import pickle

    from mlaserve.config import EngineConfig
    from mlaserve.kernels.pdl import pdl_args

    set_pdl(True)
    x = torch.zeros(1, device="cuda")
    cfg = EngineConfig(model="m")
    set_pdl(False)  # a rank's own environment no longer matters: it runs rank 0's config
    assert pdl_args(x, pickle.loads(pickle.dumps(cfg)).kernels.pdl) == dict(PDL=True, launch_pdl=True)
    assert pdl_args(x, EngineConfig(model="m").kernels.pdl) == dict(PDL=False, launch_pdl=False)


def test_engine_greedy_with_and_without_pdl(set_pdl, tiny_ckpt):
    """Decode graphs captured with PDL give the tokens of graphs captured without it (tiny model, bf16)."""
    from tests.gpu.test_engine_gpu import _greedy, _prompts

    prompts = _prompts(8, seed=5)
    set_pdl(False)
    off, _ = _greedy(dict(dtype="bfloat16"), tiny_ckpt, prompts, max_tokens=24)
    set_pdl(True)
    on, llm = _greedy(dict(dtype="bfloat16"), tiny_ckpt, prompts, max_tokens=24)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs and llm.engine.runner.kernels.pdl
    assert on == off
