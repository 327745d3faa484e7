"""The absorbed MLA form (decode, q_len 1 or N) equals the naive form (prefill) over the same cache contents:
for the whole model, and for one attention layer against a dense einsum written here from docs/design.md §1."""

import pytest
import torch

from mlaserve.attention.base import ForwardBatch, SeqChunk
from mlaserve.attention.torch_ref import TorchRefBackend
from mlaserve.config import ModelConfig
from mlaserve.distributed.tp import RankInfo
from mlaserve.layers.rotary import RotaryEmbedding
from mlaserve.models.deepseek_v3 import DeepseekV3Attention
from mlaserve.models.make_random import load_preset

from .helpers import RefRunner, load_model, make_tiny

REL = 1e-5


def assert_rel_close(got, ref, rel=REL):
    assert torch.isfinite(got).all()
    diff, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert diff <= rel * scale, f"max diff {diff:.3g} > {rel:g} x {scale:.3g}"


# ---- whole model -------------------------------------------------------------------------------------


@pytest.fixture(
    scope="module", params=[{}, {"q_lora_rank": None, "v_head_dim": 12, "rope_scaling": None}], ids=["tiny", "variant"]
)
def model(request, tmp_path_factory):
    return load_model(make_tiny(tmp_path_factory.mktemp("forms"), seed=3, **request.param))


def contexts_and_new_tokens(ctx_lens, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = [torch.randint(0, 512, (n,), generator=g).tolist() for n in ctx_lens]
    new = [torch.randint(0, 512, (k,), generator=g).tolist() for _ in ctx_lens]
    return ctx, new


@pytest.mark.parametrize("k", [1, 2, 5])
def test_decode_equals_prefill_over_same_cache(model, k):
    """The same k new tokens per request, computed three ways after one shared prefill: k decode steps of
    q_len 1, one decode step of q_len k (a verify block), and one prefill chunk with num_cached > 0."""
    ctx, new = contexts_and_new_tokens((1, 7, 13, 30), k)
    runner = RefRunner(model, num_pages=256)
    seqs, _ = runner.prefill(ctx)

    as_prefill = runner.step(prefill=[(runner.fork(s), t) for s, t in zip(seqs, new)], need_logits="all")
    as_block = runner.step(decode=[(runner.fork(s), t) for s, t in zip(seqs, new)], need_logits="all")
    one_by_one = [runner.fork(s) for s in seqs]
    steps = [runner.step(decode=[(s, t[j : j + 1]) for s, t in zip(one_by_one, new)]) for j in range(k)]
    for b in range(len(ctx)):
        ref = as_prefill[b]  # [k, vocab]
        assert_rel_close(as_block[b], ref)
        assert_rel_close(torch.cat([steps[j][b] for j in range(k)]), ref)


def test_cache_contents_do_not_depend_on_the_form(model):
    """store_kv writes the same latent whichever form attends afterwards: bit-identical in layer 0 (its
    input does not depend on attention), within REL in later layers."""
    ctx, new = contexts_and_new_tokens((5, 11), 3, seed=1)
    runner = RefRunner(model)
    seqs, _ = runner.prefill(ctx)
    a, b = [runner.fork(s) for s in seqs], [runner.fork(s) for s in seqs]
    runner.step(prefill=list(zip(a, new)), need_logits="none")
    runner.step(decode=list(zip(b, new)), need_logits="none")
    for sa, sb in zip(a, b):
        n = sa.num_cached
        lat_a = runner.kv_cache[:, sa.pages].flatten(1, 2)[:, :n]
        lat_b = runner.kv_cache[:, sb.pages].flatten(1, 2)[:, :n]
        assert torch.equal(lat_a[0], lat_b[0])
        assert_rel_close(lat_a, lat_b)


# ---- one attention layer -----------------------------------------------------------------------------


def rope_complex(x, positions, inv_freq, scale):
    """RoPE on interleaved pairs as complex multiplication (DeepSeek's reference form). x [T, ..., P]."""
    angles = positions.float()[:, None] * inv_freq  # [T, P/2]
    rot = torch.polar(torch.full_like(angles, scale), angles)
    rot = rot.view(rot.shape[0], *([1] * (x.dim() - 2)), rot.shape[1])
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * rot).flatten(-2)


def mla_dense(attn: DeepseekV3Attention, x, positions, rotary):
    """Causal MLA over one whole sequence x [T, D], the naive form written from the formulas."""
    T, H, N, P, R, V = x.shape[0], attn.H, attn.N, attn.P, attn.R, attn.V
    if attn.q_lora_rank:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    else:
        q = attn.q_proj(x)
    q = q.view(T, H, N + P)
    kv_a = attn.kv_a_proj_with_mqa(x)
    c_kv = attn.kv_a_layernorm(kv_a[:, :R])
    k_pe = rope_complex(kv_a[:, R:], positions, rotary.inv_freq, rotary.scale)  # [T, P]
    q_pe = rope_complex(q[..., N:], positions, rotary.inv_freq, rotary.scale)  # [T, H, P]
    kv = (c_kv @ attn.kv_b_proj.weight.T).view(T, H, N + V)
    scores = torch.einsum("qhn,khn->hqk", q[..., :N], kv[..., :N]) + torch.einsum("qhp,kp->hqk", q_pe, k_pe)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = (scores * attn.scale).masked_fill(~causal, float("-inf")).softmax(-1)
    o = torch.einsum("hqk,khv->qhv", probs, kv[..., N:])
    return attn.o_proj(o.reshape(T, H * V))


@pytest.fixture(scope="module", params=[{}, {"q_lora_rank": None, "v_head_dim": 16}], ids=["tiny", "variant"])
def layer(request):
    raw = load_preset("tiny")
    raw.update(request.param)
    cfg = ModelConfig.from_hf(raw)
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg, layer_id=0, ranks=RankInfo(), dtype=torch.float32)
    for name, p in attn.named_parameters():
        if "layernorm" in name:
            p.data = 1 + 0.1 * torch.randn_like(p)
        else:
            p.data = torch.randn_like(p) / p.shape[-1] ** 0.5
    return attn, RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim), cfg


def run_layer(attn, rotary, cfg, x_ctx, x_new, as_decode, page_size=4):
    """Prefill each request's context, then run its new tokens as decode (or as prefill). Returns the new
    tokens' outputs, concatenated."""
    B = len(x_ctx)
    cache = torch.zeros(1, 64, page_size, cfg.kv_cache_dim)
    backend = TorchRefBackend(cache, cfg.kv_lora_rank)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    pages = [perm[i * 16 : (i + 1) * 16] for i in range(B)]

    def forward(chunks_x, num_cached, decode):
        chunks = [SeqChunk([0] * len(xs), n, pages[i]) for i, (xs, n) in enumerate(zip(chunks_x, num_cached))]
        batch = ForwardBatch.build(chunks if decode else [], [] if decode else chunks, page_size, "cpu", backend)
        cos, sin = rotary(batch.positions)
        return attn(torch.cat(chunks_x), cos, sin, batch)

    with torch.no_grad():
        forward(x_ctx, [0] * B, decode=False)
        return forward(x_new, [len(x) for x in x_ctx], decode=as_decode)


@pytest.mark.parametrize("q_len", [1, 3])
def test_layer_absorbed_equals_naive_and_dense(layer, q_len):
    attn, rotary, cfg = layer
    g = torch.Generator().manual_seed(q_len)
    ctx_lens = (1, 6, 21)
    x_ctx = [torch.randn(n, cfg.hidden_size, generator=g) for n in ctx_lens]
    x_new = [torch.randn(q_len, cfg.hidden_size, generator=g) for _ in ctx_lens]

    absorbed = run_layer(attn, rotary, cfg, x_ctx, x_new, as_decode=True)
    naive = run_layer(attn, rotary, cfg, x_ctx, x_new, as_decode=False)
    assert_rel_close(absorbed, naive)
    with torch.no_grad():
        dense = torch.cat(
            [
                mla_dense(attn, torch.cat([c, n]), torch.arange(len(c) + q_len), rotary)[-q_len:]
                for c, n in zip(x_ctx, x_new)
            ]
        )
    assert_rel_close(naive, dense)
    assert_rel_close(absorbed, dense)
