"""Parity with transformers' DeepseekV3ForCausalLM (same folder, fp32, CPU): full-prompt logits, batched and
chunked prefill, and step-by-step greedy decode through the absorbed path against generate()."""

import pytest
import torch

from .helpers import RefRunner, generate_greedy, load_model, make_tiny
from .hf_ref import hf_greedy, hf_logits, hf_model

pytest.importorskip("transformers")

# Each config changes one or two features of the tiny preset (q_lora 48, YaRN with mscale, n_group 2 /
# topk_group 1, one shared expert, v_head_dim 24 != qk_nope_head_dim 16).
CONFIGS = {
    "tiny": {},
    "no_q_lora": {"q_lora_rank": None},
    "group_limited": {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
    "no_yarn": {"rope_scaling": None, "rope_theta": 50000.0},
    "yarn_no_mscale": {
        "rope_scaling": {
            "type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
        }
    },
    "two_shared_small_v": {
        "n_shared_experts": 2,
        "v_head_dim": 12,
        "norm_topk_prob": False,
        "first_k_dense_replace": 0,
    },
    # Kimi-K2.5's RoPE, eps and scaling factor (its rms_norm_eps 1e-5 also reaches q_a/kv_a_layernorm here,
    # where transformers keeps 1e-6: a ~1e-5-relative difference, inside the tolerance).
    "kimi_like": {
        "rms_norm_eps": 1e-5,
        "routed_scaling_factor": 2.827,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
        },
    },
}
PROMPT_LENS = (1, 5, 17, 40)


def prompts(lens, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4):
    assert got.shape == ref.shape
    assert torch.isfinite(got).all()
    tol = rel * ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    assert diff <= tol, f"max |logit diff| {diff:.3g} > {tol:.3g} ({rel:g} x max |ref logit|)"


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(mlaserve model, transformers model) loaded from one random folder."""
    path = make_tiny(tmp_path_factory.mktemp(request.param), seed=1, **CONFIGS[request.param])
    return load_model(path), hf_model(path)


def test_prefill_each_prompt_alone(pair):
    model, hf = pair
    for ids in prompts(PROMPT_LENS):
        _, (logits,) = RefRunner(model).prefill([ids])
        assert_logits_close(logits, hf_logits(hf, ids))


def test_prefill_batch_of_prompts_in_one_forward(pair):
    model, hf = pair
    batch = prompts(PROMPT_LENS, seed=2)
    _, logits = RefRunner(model).prefill(batch)
    for ids, lg in zip(batch, logits):
        assert_logits_close(lg, hf_logits(hf, ids))


def test_chunked_prefill_over_several_steps(pair):
    model, hf = pair
    batch = prompts((23, 9, 40), seed=3)
    _, logits = RefRunner(model).prefill(batch, chunk=7)
    for ids, lg in zip(batch, logits):
        assert_logits_close(lg, hf_logits(hf, ids))


def test_greedy_decode_matches_generate(pair):
    """16 steps one token at a time through the absorbed path, three requests decoding in one batch."""
    model, hf = pair
    batch = prompts((3, 12, 30), seed=4)
    tokens, logits = generate_greedy(RefRunner(model), batch, steps=16)
    for b, ids in enumerate(batch):
        ref_tokens, ref_logits = hf_greedy(hf, ids, 16)
        assert tokens[b] == ref_tokens
        assert_logits_close(logits[:, b], ref_logits)


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_sizes(pair, page_size):
    """Chunked prefill then decode with one slot per page, and with pages larger than some prompts."""
    model, hf = pair
    batch = prompts((5, 21), seed=7)
    tokens, logits = generate_greedy(RefRunner(model, page_size=page_size), batch, steps=4, chunk=8)
    for b, ids in enumerate(batch):
        ref = hf_logits(hf, ids + tokens[b][:-1])[len(ids) - 1 :]
        assert_logits_close(logits[:, b], ref)


def test_mixed_decode_and_prefill_batch(pair):
    """Decode requests and prefill chunks in the same ForwardBatch give each request its own logits."""
    model, hf = pair
    a, b, c = prompts((10, 14, 6), seed=5)
    runner = RefRunner(model)
    (sa, sb), _ = runner.prefill([a[:-1], b[:8]])
    sc = runner.new_seq()
    la, lb, lc = runner.step(decode=[(sa, a[-1:])], prefill=[(sb, b[8:]), (sc, c)], need_logits="all")
    assert_logits_close(la, hf_logits(hf, a)[-1:])
    assert_logits_close(lb, hf_logits(hf, b)[8:])
    assert_logits_close(lc, hf_logits(hf, c))


def test_tied_word_embeddings(tmp_path):
    """tie_word_embeddings: the checkpoint has no lm_head; both sides use embed_tokens."""
    path = make_tiny(tmp_path, seed=1, tie_word_embeddings=True)
    model, hf = load_model(path), hf_model(path)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    for ids in prompts((6, 25), seed=6):
        _, (logits,) = RefRunner(model).prefill([ids])
        assert_logits_close(logits, hf_logits(hf, ids))
