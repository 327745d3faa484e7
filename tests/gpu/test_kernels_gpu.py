"""The Triton kernels at real model sizes on CUDA: the interpreter tests' checks, plus CUDA-graph replays with
changed lengths and routings. Run:  PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_kernels_gpu.py"""

import random

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import kernel_checks as kc

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_seed")]
BF = torch.bfloat16


def _ctx(B, q_len, max_len=8192):
    lens = [q_len, max_len, 64, 65, 1000 + q_len] + [random.randint(q_len, max_len) for _ in range(B)]
    return lens[:B]


# --- mla_decode -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "H,q_len,page,B",
    [
        (16, 1, 64, 16),
        (16, 2, 64, 16),
        (16, 4, 64, 8),
        (16, 32, 64, 4),  # a short suffix's rows (engine/suffix.py)
        (64, 32, 16, 2),
        (64, 1, 64, 16),
        (64, 2, 16, 8),
        (128, 1, 64, 4),
        (20, 1, 16, 5),
    ],
)
def test_mla_decode_real(H, q_len, page, B):
    kc.check_mla_decode("cuda", BF, H=H, R=512, P=64, q_len=q_len, ctx_lens=_ctx(B, q_len), page_size=page)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_mla_decode_explicit_splits_strided_out(num_splits):
    # 64 splits over short contexts: many empty splits
    kc.check_mla_decode(
        "cuda",
        BF,
        H=16,
        R=512,
        P=64,
        q_len=2,
        ctx_lens=[2, 300, 5000, 64],
        page_size=64,
        num_splits=num_splits,
        strided_out=True,
    )


@pytest.mark.parametrize("q_len,stages", [(1, 3), (2, 3), (1, 4)])
def test_mla_decode_tma_real_dims(q_len, stages):
    # TMA whole tiles + the masked last tile, at the real latent dims (contexts ending mid-tile, on tile edges)
    kc.check_mla_decode(
        "cuda",
        BF,
        H=16,
        R=512,
        P=64,
        q_len=q_len,
        ctx_lens=_ctx(16, q_len),
        page_size=64,
        config=dict(TMA=True, num_stages=stages),
    )


def test_mla_decode_fp32_and_tiny_dims():
    kc.check_mla_decode("cuda", torch.float32, H=16, R=512, P=64, q_len=2, ctx_lens=[2, 700, 3000], page_size=64)
    for dtype in (BF, torch.float32):
        kc.check_mla_decode("cuda", dtype, H=4, R=32, P=8, q_len=2, ctx_lens=[2, 17, 600], page_size=16)


@pytest.mark.parametrize("config", [None, {"TMA": True}])
def test_mla_decode_cuda_graph_replay_with_new_lengths(config):
    from mlaserve.kernels.mla_decode import mla_decode
    from tests.helpers.kernel_refs import mla_decode_ref

    B, H, R, P, q_len, page = 8, 16, 512, 64, 2, 64
    kv, table, seq_lens = kc.make_paged([8192] * B, page, R + P, BF, "cuda")
    q = torch.randn(B * q_len, H, R + P, device="cuda").to(BF)
    out = torch.empty(B * q_len, H, R, device="cuda", dtype=BF)
    seq_lens.copy_(torch.tensor([100, 2, 8000, 3000, 64, 65, 4096, 7], dtype=torch.int32))
    g, _ = kc.cuda_graph(lambda: mla_decode(q, kv, table, seq_lens, q_len, 0.07, out, config=config))
    for lens in ([101, 3, 8001, 3001, 65, 66, 4097, 8], [8192, 8192, 2, 5000, 300, 1, 16, 2]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(BF))
        out.fill_(float("nan"))
        g.replay()
        ref = mla_decode_ref(q, kv, table, seq_lens, q_len, 0.07, R)
        valid = torch.tensor(lens).repeat_interleave(q_len) >= q_len  # seq_len 1 < q_len 2: rows undefined
        kc.assert_close(out[valid.cuda()], ref[valid.cuda()], BF, f"mla_decode graph replay lens={lens}")


@pytest.mark.parametrize("B,config", [(1, None), (16, None), (16, {"TMA": True})])
def test_mla_decode_cuda_graph_replay_poisoned_partials(B, config):
    # the engine's decode shape (q_len 1, default splits; B=1: 64 splits, most empty at 512, pointer loads) captured
    # once with NaN-poisoned partial buffers; replayed twice with new q and lengths, contexts 512 and 8192 and a
    # padding row (seq_len 0)
    from mlaserve.kernels.mla_decode import mla_decode
    from tests.helpers.kernel_refs import mla_decode_ref

    H, R, P, q_len, page = 16, 512, 64, 1, 64
    kv, table, seq_lens = kc.make_paged([8192] * B, page, R + P, BF, "cuda")
    q = torch.randn(B * q_len, H, R + P, device="cuda").to(BF)
    out = torch.empty(B * q_len, H, R, device="cuda", dtype=BF)
    seq_lens.fill_(300)

    def step():
        with kc.poisoned_empty():  # capture-time fills are graph nodes: every replay re-poisons the partials
            mla_decode(q, kv, table, seq_lens, q_len, 0.07, out, config=config)

    g, _ = kc.cuda_graph(step)
    for top in (512, 8192):
        lens = ([top] + [random.randint(1, top) for _ in range(B - 2)] + [0])[:B]
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_((0.3 * torch.randn_like(q, dtype=torch.float32)).to(BF))
        out.fill_(float("nan"))
        g.replay()
        ref = mla_decode_ref(q, kv, table, seq_lens, q_len, 0.07, R)
        kc.assert_close(out, ref, BF, f"mla_decode graph replay B={B} lens={lens[:4]}..")


# --- prefill attention ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["triton", "sdpa"])
def test_prefill_real_dims(impl):
    kc.check_prefill(
        "cuda", BF, H=16, Dqk=192, Dv=128, q_lens=[512, 1, 300, 1000, 129], k_lens=[512, 700, 300, 3000, 129], impl=impl
    )


def test_prefill_8192_and_tiny_dims():
    kc.check_prefill("cuda", BF, H=16, Dqk=192, Dv=128, q_lens=[8192], k_lens=[8192])
    kc.check_prefill("cuda", BF, H=4, Dqk=24, Dv=24, q_lens=[5, 70, 1], k_lens=[5, 200, 9])
    kc.check_prefill("cuda", torch.float32, H=4, Dqk=24, Dv=24, q_lens=[5, 70, 1], k_lens=[5, 200, 9])
    kc.check_prefill("cuda", torch.float32, H=2, Dqk=192, Dv=128, q_lens=[300], k_lens=[400])


@pytest.mark.parametrize("cfg", [None, dict(HEAD_GROUP=1), dict(HEAD_GROUP=16), dict(BLOCK_M=64, BLOCK_N=32)])
def test_prefill_mla_two_source_real_dims(cfg):
    # M1 shapes (H=16, N=128, P=64, V=128): k_nope/v views of one projection, k_rope of the latent (head stride 0).
    # Fresh prompts, chunks over cached context (q shorter than k), single tokens, several requests per batch.
    kc.check_prefill_mla(
        "cuda",
        BF,
        H=16,
        N=128,
        P=64,
        Dv=128,
        q_lens=[512, 1, 300, 1000, 129, 2048],
        k_lens=[512, 700, 300, 3000, 129, 6000],
        config=cfg,
        R=512,
    )


def test_prefill_mla_8192_and_other_dims():
    kc.check_prefill_mla("cuda", BF, H=16, N=128, P=64, Dv=128, q_lens=[8192], k_lens=[8192], R=512)
    kc.check_prefill_mla("cuda", BF, H=16, N=128, P=64, Dv=128, q_lens=[4096], k_lens=[8192], R=512)
    kc.check_prefill_mla("cuda", BF, H=128, N=128, P=64, Dv=128, q_lens=[700, 64], k_lens=[900, 64], R=512)
    kc.check_prefill_mla("cuda", BF, H=4, N=16, P=8, Dv=24, q_lens=[5, 70, 1], k_lens=[5, 200, 9])  # tiny preset
    kc.check_prefill_mla("cuda", torch.float32, H=4, N=16, P=8, Dv=24, q_lens=[5, 70, 1], k_lens=[5, 200, 9])
    kc.check_prefill_mla("cuda", torch.float32, H=2, N=128, P=64, Dv=128, q_lens=[300], k_lens=[400])
    kc.check_prefill_mla("cuda", BF, H=16, N=128, P=64, Dv=128, q_lens=[300, 5], k_lens=[400, 5], rope_per_head=True)


def _mla_prefill_views(H, C, Tp, rope_per_head=False):
    """q [Tp, H, 192]; k_nope, v views of one [C, H, 256] projection; k_rope a view of the latent [C, 576] (or of
    a [C, H, 64 + 16] tensor), as the model passes them."""
    q = torch.randn(Tp, H, 192, device="cuda").to(BF)
    kv = torch.randn(C, H, 256, device="cuda").to(BF)
    if rope_per_head:
        k_rope = torch.randn(C, H, 80, device="cuda").to(BF)[..., 16:]
    else:
        k_rope = torch.randn(C, 576, device="cuda").to(BF)[:, 512:]
    return q, kv[..., :128], k_rope, kv[..., 128:]


@pytest.mark.parametrize(
    "H,q_lens,k_lens,rope_per_head",
    [
        (16, [512, 1, 300, 1000, 129, 2048], [512, 700, 300, 3000, 129, 6000], False),
        (16, [8192], [8192], False),
        (128, [700, 64, 5], [900, 64, 5], False),
        (64, [4096], [8192], False),
        (16, [300, 5, 128, 257], [400, 5, 128, 300], True),
    ],
)
def test_prefill_mla_gluon_same_bits_as_triton(H, q_lens, k_lens, rope_per_head):
    # the Gluon kernel issues the Triton kernel's MMAs in the same K order with the same softmax operations:
    # every output bit equal, every row written (NaN-poisoned outputs), on fresh prompts and chunks over a prefix
    from mlaserve.kernels.prefill_attention import prefill_attention_mla
    from mlaserve.kernels.prefill_attention_gluon import prefill_attention_mla_gluon, supported
    from tests.helpers.kernel_refs import prefill_attention_ref

    Tp, C = sum(q_lens), sum(k_lens)
    q, k_nope, k_rope, v = _mla_prefill_views(H, C, Tp, rope_per_head)
    cu_q = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, device="cuda").cumsum(0).to(torch.int32)
    out_t = torch.full((Tp, H, 128), float("nan"), device="cuda", dtype=BF)
    out_g = out_t.clone()
    assert supported(q, k_nope, k_rope, v, out_g)
    prefill_attention_mla(q, k_nope, k_rope, v, cu_q, cu_k, 192**-0.5, out_t, max(q_lens))
    prefill_attention_mla_gluon(q, k_nope, k_rope, v, cu_q, cu_k, 192**-0.5, out_g, max(q_lens))
    assert not out_g.isnan().any()
    assert torch.equal(out_g, out_t)
    if Tp <= 4096:
        k_full = torch.cat([k_nope, k_rope.expand(C, H, 64) if rope_per_head else k_rope[:, None].expand(C, H, 64)], -1)
        ref = prefill_attention_ref(q, k_full, v, cu_q, cu_k, 192**-0.5)
        kc.assert_close(out_g, ref, BF, f"prefill_attention_mla_gluon H={H} q={q_lens[:4]}")


def test_prefill_mla_gluon_supported_only_for_its_dims():
    from mlaserve.kernels.prefill_attention_gluon import supported

    q, k_nope, k_rope, v = _mla_prefill_views(4, 64, 64)
    out = torch.empty(64, 4, 128, device="cuda", dtype=BF)
    assert supported(q, k_nope, k_rope, v, out)
    assert not supported(q.float(), k_nope.float(), k_rope.float(), v.float(), out.float())
    assert not supported(q[..., :96], k_nope[..., :64], k_rope[..., :32], v, out)  # other head dims
    odd = torch.randn(64, 4 * 192 + 1, device="cuda").to(BF)[:, 1:].view(64, 4, 192)  # a base TMA cannot address
    assert not supported(odd, k_nope, k_rope, v, out)


@pytest.mark.parametrize("impl", ["triton", "gluon"])
def test_prefill_mla_cuda_graph_replay_with_new_lengths(impl):
    from mlaserve.kernels.prefill_attention import prefill_attention_mla
    from mlaserve.kernels.prefill_attention_gluon import prefill_attention_mla_gluon
    from tests.helpers.kernel_refs import prefill_attention_ref

    if impl == "gluon":
        prefill_attention_mla = prefill_attention_mla_gluon  # noqa: F811

    H, N, P, V, T = 16, 128, 64, 128, 2048
    q = torch.randn(T, H, N + P, device="cuda").to(BF)
    kv, latent = torch.randn(T, H, N + V, device="cuda").to(BF), torch.randn(T, 512 + P, device="cuda").to(BF)
    cu = torch.tensor([0, 1000, 1500, T], dtype=torch.int32, device="cuda")
    out = torch.empty(T, H, V, device="cuda", dtype=BF)
    args = (q, kv[..., :N], latent[:, 512:], kv[..., N:])
    g, _ = kc.cuda_graph(lambda: prefill_attention_mla(*args, cu, cu, 0.07, out, T))
    for bounds in ([0, 7, 1800, T], [0, T, T, T]):
        cu.copy_(torch.tensor(bounds, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        k_full = torch.cat([kv[..., :N], latent[:, None, 512:].expand(T, H, P)], -1)
        ref = prefill_attention_ref(q, k_full, kv[..., N:], cu, cu, 0.07)
        kc.assert_close(out, ref, BF, f"prefill_attention_mla graph replay cu={bounds}")


# --- fused MoE and routing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 7, 64, 333, 2048, 8192])
def test_fused_moe_moonlight(T):
    kc.check_fused_moe("cuda", BF, T=T, D=2048, I=1408, E_total=64, E_local=64, offset=0, K=6)


@pytest.mark.parametrize("T", [1, 64, 1024])
def test_fused_moe_kimi_tp4(T):
    kc.check_fused_moe("cuda", BF, T=T, D=7168, I=512, E_total=384, E_local=384, offset=0, K=8)


def test_fused_moe_expert_parallel_fp32_tiny():
    kc.check_fused_moe("cuda", BF, T=200, D=7168, I=512, E_total=384, E_local=96, offset=192, K=8)
    kc.check_fused_moe("cuda", torch.float32, T=100, D=2048, I=1408, E_total=64, E_local=64, offset=0, K=6)
    kc.check_fused_moe("cuda", BF, T=9, D=64, I=32, E_total=8, E_local=8, offset=0, K=2)


@pytest.mark.parametrize("T", [1, 2, 4, 11])
@pytest.mark.parametrize("no_align", [True, False])
def test_fused_moe_no_align(T, no_align):
    # each (token, k) pair its own block (default up to no_align_max_pairs = 16 pairs) vs aligned, both forced
    kc.check_fused_moe(
        "cuda", BF, T=T, D=2048, I=1408, E_total=64, E_local=64, offset=0, K=6, config=dict(no_align=no_align)
    )
    kc.check_fused_moe(
        "cuda", BF, T=T, D=7168, I=512, E_total=384, E_local=96, offset=96, K=8, config=dict(no_align=no_align)
    )


def test_fused_moe_per_gemm_configs():
    for cfg in (
        {"gemm1": dict(BLOCK_N=64, num_warps=4, num_stages=4), "gemm2": dict(BLOCK_N=256, num_stages=3)},
        {"gemm1": dict(BLOCK_M=64, GROUP_M=16), "gemm2": dict(BLOCK_N=128, BLOCK_K=128, num_stages=3)},
    ):
        kc.check_fused_moe("cuda", BF, T=2048, D=2048, I=1408, E_total=64, E_local=64, offset=0, K=6, config=cfg)
    kc.check_fused_moe(
        "cuda",
        BF,
        T=8,
        D=2048,
        I=1408,
        E_total=64,
        E_local=64,
        offset=0,
        K=6,
        config={"gemm1": dict(BLOCK_N=32, BLOCK_K=256, num_stages=3), "gemm2": dict(num_warps=2)},
    )


@pytest.mark.parametrize("T", [1, 16])
def test_fused_moe_cuda_graph_replay_with_new_routing(T):
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref

    D, I, E, K = 2048, 1408, 64, 6  # T=1: the no-align path; 16: single-program align
    x = torch.randn(T, D, device="cuda").to(BF)
    w13 = (torch.randn(E, 2 * I, D, device="cuda") / D**0.5).to(BF)
    w2 = (torch.randn(E, D, I, device="cuda") / I**0.5).to(BF)
    ids = torch.zeros(T, K, dtype=torch.int64, device="cuda")
    w = torch.ones(T, K, device="cuda")
    g, out = kc.cuda_graph(lambda: fused_experts(x, w13, w2, w, ids, 0))
    for _ in range(2):
        ids.copy_(torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]))
        w.copy_(torch.rand(T, K, device="cuda"))
        x.copy_(torch.randn(T, D, device="cuda").to(BF))
        g.replay()
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids, 0)
        kc.assert_close(out, ref, BF, "fused_moe graph replay")


@pytest.mark.parametrize(
    "T,D,I,E,K,S", [(1, 2048, 1408, 64, 6, 2), (2, 2048, 1408, 64, 6, 2), (1, 7168, 512, 384, 8, 1)]
)
def test_fused_moe_tma_weights_equal_pointer_loads(T, D, I, E, K, S):
    """TMA weight tiles (the sm_90 decode default) == cp.async pointer loads bit for bit at real decode shapes; a shape
    the tiles do not divide falls back to the pointer loads unless TMA is asked for."""
    from mlaserve.kernels.fused_moe import fused_experts

    x = torch.randn(T, D, device="cuda").to(BF)
    w13 = (torch.randn(E, 2 * I, D, device="cuda") / D**0.5).to(BF)
    w2 = (torch.randn(E, D, I, device="cuda") / I**0.5).to(BF)
    sh = tuple((torch.randn(*s, device="cuda") / s[1] ** 0.5).to(BF) for s in ((S * I, D), (S * I, D), (D, S * I)))
    ids = torch.cat(
        [
            torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]),
            E + torch.arange(S, device="cuda").expand(T, S),
        ],
        1,
    )
    w = torch.cat([torch.rand(T, K, device="cuda"), torch.ones(T, S, device="cuda")], 1)
    with kc.poisoned_empty():
        tma = fused_experts(x, w13, w2, w, ids, 0, config=dict(tma=True), shared=sh)
    ptr = fused_experts(x, w13, w2, w, ids, 0, config=dict(tma=False), shared=sh)
    assert torch.equal(tma, ptr)
    assert torch.equal(fused_experts(x, w13, w2, w, ids, 0, shared=sh), ptr)  # the default
    odd = (w13[:, :, : D - 8].contiguous(), w2[:, : D - 8].contiguous())  # D - 8: no whole 128-wide K tiles
    out = fused_experts(
        x[:, : D - 8].contiguous(),
        *odd,
        w,
        ids,
        0,
        shared=(sh[0][:, : D - 8].contiguous(), sh[1][:, : D - 8].contiguous(), sh[2][: D - 8].contiguous()),
    )
    assert torch.equal(
        out,
        fused_experts(
            x[:, : D - 8].contiguous(),
            *odd,
            w,
            ids,
            0,
            config=dict(tma=False),
            shared=(sh[0][:, : D - 8].contiguous(), sh[1][:, : D - 8].contiguous(), sh[2][: D - 8].contiguous()),
        ),
    )


@pytest.mark.parametrize(
    "T,K,E,E_local,offset,bm",
    [
        (1, 6, 64, 64, 0, 16),
        (64, 6, 64, 64, 0, 16),
        (21, 6, 64, 64, 0, 16),
        (22, 6, 64, 64, 0, 16),
        (170, 6, 64, 64, 0, 32),
        (8192, 6, 64, 64, 0, 128),
        (8192, 8, 384, 384, 0, 128),
        (3000, 8, 384, 96, 192, 64),
        (8192, 8, 256, 256, 0, 16),
    ],
)
@pytest.mark.parametrize("shared", [0, 2])
def test_moe_align_real(T, K, E, E_local, offset, bm, shared):
    # one program up to FUSED_COUNT_MAX = 128 pairs at <= 128 experts (T=21 x 6), the histogram + chunks above;
    # shared: the last 2 slots are fused shared experts (two more experts, placed without counting)
    if shared and offset:
        pytest.skip("shared experts are fused on one rank only (offset 0)")
    E, E_local, K = E + shared, E_local + shared, K + shared
    kc.check_moe_align("cuda", T=T, K=K, E_total=E, E_local=E_local, offset=offset, block_m=bm, shared=shared)


def test_fused_moe_prefill_graph_replay_multi_program_align():
    # T*K = 12288 pairs: the multi-program align inside a captured graph, replayed with new routings
    from mlaserve.kernels.fused_moe import fused_experts
    from mlaserve.layers.moe import fused_experts_ref

    T, D, I, E, K = 2048, 2048, 1408, 64, 6
    x = torch.randn(T, D, device="cuda").to(BF)
    w13 = (torch.randn(E, 2 * I, D, device="cuda") / D**0.5).to(BF)
    w2 = (torch.randn(E, D, I, device="cuda") / I**0.5).to(BF)
    ids = torch.zeros(T, K, dtype=torch.int64, device="cuda")
    w = torch.ones(T, K, device="cuda")
    g, out = kc.cuda_graph(lambda: fused_experts(x, w13, w2, w, ids, 0))
    for skew in (False, True):
        ids.copy_(torch.rand(T, E, device="cuda").topk(K, -1).indices)
        if skew:  # most tokens on the same 6 experts: many blocks per expert
            ids[: T * 3 // 4] = torch.arange(K, device="cuda")
        w.copy_(torch.rand(T, K, device="cuda"))
        g.replay()
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids, 0)
        kc.assert_close(out, ref, BF, f"fused_moe graph replay T={T} skew={skew}")


@pytest.mark.parametrize("E,G,TG,K", [(64, 1, 1, 6), (384, 1, 1, 8), (256, 8, 4, 8), (8, 2, 1, 2)])
def test_routing_real(E, G, TG, K):
    kc.check_routing("cuda", T=4096, E=E, n_group=G, topk_group=TG, K=K)


@pytest.mark.parametrize("E,G,TG,K,S,scaling", [(64, 1, 1, 6, 2, 1.0), (160, 8, 3, 6, 2, 16.0)])
def test_routing_softmax_real(E, G, TG, K, S, scaling):
    """DeepSeek-V2-Lite (greedy) and DeepSeek-V2 (group_limited_greedy) routing at real sizes."""
    kc.check_routing(
        "cuda",
        T=4096,
        E=E,
        n_group=G,
        topk_group=TG,
        K=K,
        norm=False,
        scaling=scaling,
        num_shared=S,
        shared_id0=E,
        scoring_func="softmax",
    )


def test_routing_cuda_graph():
    from mlaserve.kernels.routing import route_noaux_tc_logits
    from mlaserve.layers.moe import route_noaux_tc

    logits, bias = torch.randn(64, 256, device="cuda"), 0.1 * torch.randn(256, device="cuda")
    g, (w, ids) = kc.cuda_graph(lambda: route_noaux_tc_logits(logits, bias, 8, 8, 4, True, 2.5))
    logits.copy_(torch.randn_like(logits))
    g.replay()
    rw, rids = route_noaux_tc(logits, bias, 8, 8, 4, True, 2.5)
    bad = (ids.sort(-1).values != rids.sort(-1).values).any(-1).nonzero().reshape(-1).tolist()
    choice = logits.sigmoid() + bias
    assert all(kc._near_tie(choice[t], 8, 4, 8) for t in bad), f"graph-replayed routing differs at tokens {bad}"


@pytest.mark.parametrize("preset", ["moonlight-16b-a3b", "kimi-k2.5", "deepseek-v3"])
@pytest.mark.parametrize("T", [1, 32, 64, 8192])
def test_router_bf16_gemm_equals_fp32_and_routes_the_same(preset, T):
    """route_noaux_tc_fused's router GEMM (bf16 operands, fp32 output) against F.linear(x.float(), w) for a gate
    loaded from bf16 values, and the routing it feeds against the torch path (near ties aside); graph-capturable."""
    from mlaserve.config import ModelConfig
    from mlaserve.kernels.routing import route_noaux_tc_fused
    from mlaserve.layers.moe import TopkRouter
    from mlaserve.models.make_random import load_preset

    cfg = ModelConfig.from_hf(load_preset(preset))
    with torch.device("cuda"):
        gate = TopkRouter(cfg)
    w = (torch.randn(cfg.n_routed_experts, cfg.hidden_size, device="cuda") / cfg.hidden_size**0.5).to(BF).float()
    gate.weight.weight_loader(gate.weight, w)
    gate.e_score_correction_bias.data.copy_(0.1 * torch.randn(cfg.n_routed_experts, device="cuda"))
    x = torch.randn(T, cfg.hidden_size, device="cuda").to(BF)
    w16 = gate.bf16_weight()
    assert w16 is not None
    got, ref = torch.mm(x, w16.t(), out_dtype=torch.float32), F.linear(x.float(), gate.weight)
    scale = F.linear(x.float().abs(), gate.weight.abs())
    assert ((got - ref).abs() / scale).max().item() < 1e-5
    if T <= 32:  # the decode path's split-K partials (torch.empty: a partial left unwritten spoils the sum)
        from mlaserve.kernels.routing import router_partials

        part = router_partials(x, w16)
        assert ((part.sum(0) - ref).abs() / scale).max().item() < 1e-5
    rw, rids = gate(x)
    g, (fw, fids) = kc.cuda_graph(lambda: route_noaux_tc_fused(gate, x))
    g.replay()
    same = (fids.sort(-1).values == rids.sort(-1).values).all(-1).float().mean().item()
    assert same > 0.99, f"{preset} T={T}: only {same:.4f} of tokens route the same"


def test_routing_shared_columns_real():
    with kc.poisoned_empty():
        kc.check_routing("cuda", T=4096, E=64, n_group=1, topk_group=1, K=6, num_shared=2, shared_id0=64)


def _moe_layers(preset, device="cuda"):
    """A bf16 Triton MoE layer at the preset's real shapes and the fp32 torch layer, on the same bf16-exact weights."""
    from mlaserve.config import ModelConfig
    from mlaserve.distributed.tp import RankInfo
    from mlaserve.models.deepseek_v3 import DeepseekV3MoE
    from mlaserve.models.dummy_weights import init_dummy_weights
    from mlaserve.models.make_random import load_preset

    cfg = ModelConfig.from_hf(load_preset(preset))
    with torch.device(device):
        layer = DeepseekV3MoE(cfg, RankInfo(), BF, "triton")
        ref = DeepseekV3MoE(cfg, RankInfo(), torch.float32, "torch")
    init_dummy_weights(ref, seed=random.randrange(1 << 30))
    for (_, p), (_, r) in zip(layer.named_parameters(), ref.named_parameters()):
        r.data = r.data.to(BF).float()
        p.weight_loader(p, r.data)
    return layer, ref


@pytest.mark.parametrize("preset", ["moonlight-16b-a3b"])
def test_moe_layer_shared_fusion_real(preset):
    """The MoE layer with the shared experts fused into the Triton MoE (T <= fuse_shared_max_tokens) against the
    unfused Triton path and the fp32 torch path, bf16, at real shapes; T = 64, 256, 300 are above the threshold
    (32), where both runs take the unfused path."""
    layer, ref = _moe_layers(preset)
    assert layer.fuse_shared == layer.shared_experts.gate_proj.out_features // layer.experts.down_proj.shape[-1]
    for T in (1, 2, 3, 16, 64, 256, 300):
        x = torch.randn(T, layer.gate.cfg.hidden_size, device="cuda").to(BF)
        want = ref(x.float())
        fused = layer(x)
        layer.fuse_shared, S = 0, layer.fuse_shared
        unfused = layer(x)
        layer.fuse_shared = S
        kc.assert_close(fused, want, BF, f"{preset} MoE layer T={T} fused vs torch fp32")
        kc.assert_close(unfused, want, BF, f"{preset} MoE layer T={T} unfused vs torch fp32")
        kc.assert_close(fused, unfused.float(), BF, f"{preset} MoE layer T={T} fused vs unfused")


def test_moe_layer_shared_fusion_cuda_graph():
    """Decode-shaped (T=1, 4) fused MoE layer captured in a CUDA graph and replayed with new inputs."""
    layer, ref = _moe_layers("moonlight-16b-a3b")
    for T in (1, 4):
        x = torch.randn(T, layer.gate.cfg.hidden_size, device="cuda").to(BF)
        g, out = kc.cuda_graph(lambda: layer(x))  # noqa: B023
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            g.replay()
            kc.assert_close(out, ref(x.float()), BF, f"fused MoE layer graph replay T={T}")


# --- RoPE + KV store ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", [16, 64])
def test_rope_store_kv_real(page):
    kc.check_rope_store_kv("cuda", BF, T=3000, R=512, P=64, page_size=page, num_pages=8192 // page)
    kc.check_rope_store_kv("cuda", BF, T=3000, R=512, P=64, page_size=page, num_pages=8192 // page, norm=True)
    kc.check_rope_store_kv("cuda", torch.float32, T=100, R=32, P=8, page_size=page, num_pages=16)


@pytest.mark.parametrize("H", [16, 128])
def test_rope_q_real(H):
    kc.check_rope_q("cuda", BF, T=1000, H=H, P=64, alias=True)
    kc.check_rope_q("cuda", BF, T=100, H=H, P=64, alias=False)
    kc.check_rope_q("cuda", BF, T=8192, H=H, P=64, alias=True)  # the 8k prefill, in place
    kc.check_rope_q("cuda", BF, T=8191, H=H, P=64, alias=False)  # a partial last token block, decode-style out
    kc.check_rope_q("cuda", BF, T=3, H=H, P=64, alias=False)
    kc.check_rope_q("cuda", torch.float32, T=77, H=H, P=64, alias=True, head_major=True)


@pytest.mark.parametrize("H,P", [(16, 128), (6, 16), (48, 64)])
def test_rope_neox_real(H, P):
    # q|k heads of Llama drafts (a TP4 rank's 16 query heads of 128, the default draft's 4 + 2 of 16, 48 of 64):
    # decode, verify and an 8k prefill, in place and into another buffer
    for T, alias in ((1, True), (16, False), (8192, True), (8191, False)):
        kc.check_rope_neox("cuda", BF, T=T, H=H, P=P, alias=alias)
    kc.check_rope_neox("cuda", torch.float32, T=77, H=H, P=P, alias=True)


@pytest.mark.parametrize("T", [1, 2, 33, 8192])
def test_rope_cos_sin_real(T):
    # bit-equal to RotaryEmbedding's torch ops at the models' 32 frequencies, unscaled (Moonlight) and YaRN-scaled
    kc.check_rope_cos_sin("cuda", T=T, half=32, scale=1.0, exact=True)
    kc.check_rope_cos_sin("cuda", T=T, half=32, scale=1.3466, exact=True)
    kc.check_rope_cos_sin("cuda", T=T, half=32, scale=1.0, pos_dtype=torch.int32, exact=True)


def test_rope_store_kv_cuda_graph():
    from mlaserve.kernels.rope_kv import rope_store_kv
    from tests.helpers.kernel_refs import rope_store_kv_ref

    T, R, P = 32, 512, 64
    cache = torch.zeros(16, 64, R + P, device="cuda", dtype=BF)
    slots = torch.arange(T, device="cuda")
    c_kv, k_pe = torch.randn(T, R, device="cuda").to(BF), torch.randn(T, P, device="cuda").to(BF)
    cos, sin = torch.rand(T, P // 2, device="cuda"), torch.rand(T, P // 2, device="cuda")
    g, _ = kc.cuda_graph(lambda: rope_store_kv(cache, slots, c_kv, k_pe, cos, sin))
    slots.copy_(torch.randperm(16 * 64, device="cuda")[:T])
    slots[-3:] = -1
    before = cache.clone()
    g.replay()
    kc.assert_close(cache, rope_store_kv_ref(before, slots, c_kv, k_pe, cos, sin), BF, "rope_store_kv graph")


# --- the model through the Triton backend --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_model_triton_backend_matches_torch_ref(tiny_ckpt, dtype):
    from tests.helpers.model_backend_check import check_model_backends

    for moe in ("torch", "triton"):
        errs = check_model_backends(tiny_ckpt, "cuda", dtype, moe)
        print(f"model logits rel err ({dtype}, moe={moe}): {errs}")


@pytest.mark.parametrize("N,K", [(3648, 2048), (2048, 2048), (1000, 7168), (576, 1536), (22528, 2048), (2048, 11264)])
def test_gemv_real(N, K):
    """The batch-1 GEMV on real projection shapes (M1's q|kv_a and o_proj; a multi-trip K; a masked K tile)
    against fp32, into a NaN-poisoned buffer; inside a CUDA graph it equals its eager launch bit for bit, and
    layers.linear sends a batch-1 bf16 row to it."""
    from mlaserve.kernels.gemv import gemv
    from mlaserve.layers.linear import linear

    x = torch.randn(1, K, device="cuda").to(BF)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(BF)
    out = torch.full((1, N), float("nan"), device="cuda", dtype=BF)
    gemv(x, w, out=out)
    kc.assert_close(out, F.linear(x.float(), w.float()), BF, f"gemv N={N} K={K}")
    g, y = kc.cuda_graph(lambda: linear(x, w))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, out)


@pytest.mark.parametrize("T", [1, 2])
def test_lm_head_gemv_real(T):
    """The lm_head of batch-1-2 decode (M1's 163840 x 2048) by the GEMV into fp32: F.linear's bf16 logits cast to
    fp32 up to summation order, into a NaN-poisoned buffer; the same greedy token as cuBLAS's where its margin is
    clear; inside a CUDA graph it equals its eager launch bit for bit."""
    from mlaserve.layers.embedding import ParallelLMHead

    head = ParallelLMHead(163840, 2048, dtype=BF).cuda()
    head.weight.data.copy_((torch.randn(163840, 2048, device="cuda") / 2048**0.5).to(BF))
    h = torch.randn(T, 2048, device="cuda").to(BF)
    ref = F.linear(h, head.weight).float()
    logits = head(h)
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.to(BF).float())  # rounded through bf16
    kc.assert_close(logits, F.linear(h.float(), head.weight.float()), BF, f"lm_head gemv T={T}")
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05
    assert torch.equal(logits.argmax(-1)[clear], ref.argmax(-1)[clear])
    g, y = kc.cuda_graph(lambda: head(h))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, logits)


@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("T", [1, 2])
def test_head_gemv_real(H, T):
    """The absorbed projections' few-token kernel on real head shapes (16: M1, Kimi-K2.5 at attention TP4; 128:
    DeepSeek-V3 at TP1), both weight layouts, into strided views of NaN-poisoned buffers, against fp32; inside a
    CUDA graph it equals its eager launch bit for bit."""
    from mlaserve.kernels.head_gemv import head_gemv

    N, V, R, P = 128, 128, 512, 64
    w = (torch.randn(H * (N + V), R, device="cuda") / R**0.5).to(BF).view(H, N + V, R)
    w_kc, w_vc = w[:, :N], w[:, N:].transpose(1, 2)
    q = torch.randn(T, H, N + P, device="cuda").to(BF)
    o_lat = torch.randn(T, H, R, device="cuda").to(BF)
    Q = torch.full((T, H, R + P), float("nan"), device="cuda", dtype=BF)
    out = torch.full((T, H * V), float("nan"), device="cuda", dtype=BF)
    head_gemv(q[..., :N], w_kc, Q[..., :R])
    head_gemv(o_lat, w_vc, out.view(T, H, V))
    kc.assert_close(Q[..., :R], torch.einsum("thn,hnr->thr", q[..., :N].float(), w_kc.float()), BF, "absorb_q")
    assert Q[..., R:].isnan().all()
    kc.assert_close(out.view(T, H, V), torch.einsum("thr,hrv->thv", o_lat.float(), w_vc.float()), BF, "absorb_out")
    Q2, out2 = torch.full_like(Q, float("nan")), torch.full_like(out, float("nan"))
    g, _ = kc.cuda_graph(lambda: (head_gemv(q[..., :N], w_kc, Q2[..., :R]), head_gemv(o_lat, w_vc, out2.view(T, H, V))))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(Q2[..., :R], Q[..., :R]) and torch.equal(out2, out)


@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("T", [1, 2])
def test_absorb_q_rope_real(H, T):
    """The query's absorption and RoPE in one launch (what DeepseekV3Attention.absorbed_q runs at batch 1-2 with
    the Triton backend) on real head shapes: q a view of the projection output beside kv_a, Q NaN-poisoned, Kimi's
    YaRN cos/sin at random positions. Bit for bit head_gemv then rope_q, close to fp32, and inside a CUDA graph
    equal to its eager launch."""
    from mlaserve.config import ModelConfig
    from mlaserve.kernels.head_gemv import absorb_q_rope, head_gemv
    from mlaserve.kernels.rope_kv import rope_q
    from mlaserve.layers.rotary import RotaryEmbedding
    from mlaserve.models.make_random import load_preset
    from tests.helpers.kernel_refs import rope_q_ref

    N, V, R, P = 128, 128, 512, 64
    w_kc = (torch.randn(H * (N + V), R, device="cuda") / R**0.5).to(BF).view(H, N + V, R)[:, :N]
    q = torch.randn(T, H * (N + P) + R + P, device="cuda").to(BF)[:, : H * (N + P)].view(T, H, N + P)
    rotary = RotaryEmbedding(ModelConfig.from_hf(load_preset("kimi-k2.5")).rope, P).cuda()
    cos, sin = rotary(torch.randint(0, 200_000, (T,), device="cuda"))
    Q = torch.full((T, H, R + P), float("nan"), device="cuda", dtype=BF)
    assert absorb_q_rope(q, w_kc, cos, sin, Q) is Q
    two = torch.full_like(Q, float("nan"))
    head_gemv(q[..., :N], w_kc, two[..., :R])
    rope_q(q[..., N:], cos, sin, two[..., R:])
    torch.cuda.synchronize()
    assert not Q.isnan().any() and torch.equal(Q, two), "absorb_q_rope differs from head_gemv + rope_q"
    kc.assert_close(Q[..., :R], torch.einsum("thn,hnr->thr", q[..., :N].float(), w_kc.float()), BF, "absorb")
    kc.assert_close(Q[..., R:], rope_q_ref(q[..., N:], cos, sin), BF, "rope")
    Q2 = torch.full_like(Q, float("nan"))
    g, _ = kc.cuda_graph(lambda: absorb_q_rope(q, w_kc, cos, sin, Q2))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(Q2, Q)


@pytest.mark.parametrize("H", [16, 64])
@pytest.mark.parametrize("T,pad", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("norm", [True, False])
def test_absorb_q_rope_store_kv_real(H, T, pad, norm):
    """The KV store (kv_a_layernorm + RoPE of k_pe into the paged cache) as one more program of absorb_q_rope's
    launch (DeepseekV3Attention.forward_decode_fused at batch 1-2) on real shapes, page size 64: Q bit for bit
    absorb_q_rope's, the rows rope_store_kv's (without the norm; with it within two bf16 ulps of the torch form,
    as the one-warp sum may round apart from rms_norm's), skipped and padding slots untouched; a CUDA graph
    replay equals the eager launch."""
    from mlaserve.kernels.head_gemv import absorb_q_rope_store_kv

    R, P, N = 512, 64, 128
    Q, cache = kc.check_absorb_q_rope_store_kv(
        "cuda", BF, T=T, H=H, N=N, R=R, P=P, norm=norm, pad=pad, page_size=64, num_pages=8, V=128
    )
    # the same launch again, captured, on fresh inputs and slots: replay == eager
    w_kc = torch.randn(H, N + 128, R, device="cuda").to(BF)[:, :N]
    proj = torch.randn(T, H * (N + P) + R + P, device="cuda").to(BF)
    q, kv_a = proj[:, : H * (N + P)].view(T, H, N + P), proj[:, H * (N + P) :]
    cos, sin = torch.randn(T, P // 2, device="cuda"), torch.randn(T, P // 2, device="cuda")
    slots = torch.randperm(8 * 64, device="cuda")[:T]
    weight = torch.randn(R, device="cuda").to(BF) if norm else None

    def launch(Qb, cb):
        return absorb_q_rope_store_kv(q, w_kc, cos, sin, Qb, cb, slots, kv_a[:, :R], kv_a[:, R:], weight, 1e-6)

    Q1, c1 = torch.full_like(Q, float("nan")), torch.full_like(cache, float("nan"))
    launch(Q1, c1)
    Q2, c2 = torch.full_like(Q, float("nan")), torch.full_like(cache, float("nan"))
    g, _ = kc.cuda_graph(lambda: launch(Q2, c2))
    Q2.fill_(float("nan"))  # what the warm-up wrote: gone
    c2.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(Q2, Q1) and torch.equal(c2.nan_to_num(7.0), c1.nan_to_num(7.0))


# --- greedy arg-max -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("B", [1, 2, 33, 64])
def test_argmax_rows_real(dtype, B):
    # the models' 163840-token vocabulary (40 blocks a row), DeepSeek's 129280 (a partial last block), a short row
    kc.check_argmax("cuda", dtype, B=B, V=163840)
    kc.check_argmax("cuda", dtype, B=B, V=129280)
    kc.check_argmax("cuda", dtype, B=B, V=1000)


# --- sampling: the race kernel ------------------------------------------------------------------------------------
@pytest.mark.parametrize("R", [5, 33])
def test_race_sample_real(R):
    # the models' vocabularies: Kimi's / Moonlight's 163840 (80 trips a row), DeepSeek's 129280 (a partial trip)
    kc.check_race_sample("cuda", R=R, V=163840)
    kc.check_race_sample("cuda", R=R, V=129280)


@pytest.mark.parametrize("V", [163840, 129280])
def test_sample_and_verify_rows_race_equal_reference(monkeypatch, V):
    """sample() and verify_rows() on the GPU (the race kernel for every row it takes) give the tokens of their
    reference path (every sampled row through the torch filter), from the same logits and generators: the kernel's
    params (which field is which, each row's noise row, the rows it leaves to the reference) are what the reference
    reads."""
    from mlaserve.layers import sampler
    from mlaserve.spec.verify import verify_rows

    torch.manual_seed(V)
    logits = torch.randn(8, V, device="cuda") * 3
    vlogits = torch.randn(8, 3, V, device="cuda") * 3
    drafts = vlogits[:, :2].argmax(-1)  # the greedy row accepts both; the sampled ones what their draws say
    race, cand = sampler._fused, sampler._candidates

    def run(fused):
        monkeypatch.setattr(sampler, "_fused", race if fused else (lambda p, V: False))
        monkeypatch.setattr(sampler, "_candidates", cand if fused else (lambda p, V: False))
        tok = sampler.sample(logits, kc.sampling_rows("cuda"), torch.Generator(device="cuda").manual_seed(5))[0]
        y, acc = verify_rows(vlogits, drafts, kc.sampling_rows("cuda"), torch.Generator(device="cuda").manual_seed(6))
        return tok, y, acc

    (tok, y, acc), (rtok, ry, racc) = run(True), run(False)
    assert torch.equal(tok, rtok), (tok.tolist(), rtok.tolist())
    assert torch.equal(y, ry) and torch.equal(acc, racc), (y.tolist(), ry.tolist())
