"""The tiny model through TritonMLABackend (+ the Triton MoE) gives TorchRefBackend's logits (interpreter)."""

import pytest
import torch

from tests.helpers.model_backend_check import check_model_backends


@pytest.mark.parametrize("dtype,moe_impl", [(torch.float32, "triton"), (torch.bfloat16, "triton")])
def test_model_logits_match_torch_ref(kdev, tiny_ckpt, dtype, moe_impl):
    check_model_backends(tiny_ckpt, kdev, dtype, moe_impl, num_splits=2)  # few splits: the interpreter is slow


def test_prefill_context_matches_ref_and_refreshes_per_forward(kdev):
    from mlaserve.attention.base import ForwardBatch, SeqChunk
    from mlaserve.attention.torch_ref import TorchRefBackend
    from mlaserve.attention.triton_mla import TritonMLABackend

    cache = torch.randn(2, 6, 16, 40, device=kdev)
    tri, ref = TritonMLABackend(cache, 32), TorchRefBackend(cache, 32)
    batch = ForwardBatch.build(
        [SeqChunk([1], 20, [4, 1])], [SeqChunk([1, 2, 3], 17, [5, 0]), SeqChunk([7], 0, [3])], 16, kdev
    )
    for layer in (0, 1):  # layer 1 reuses layer 0's metadata
        assert torch.equal(tri.prefill_context(layer, batch), ref.prefill_context(layer, batch))
    batch.page_table[1, 0] = 2  # the same batch object refilled for a new forward: layer 0 again recomputes
    assert torch.equal(tri.prefill_context(0, batch), ref.prefill_context(0, batch))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_cache", "fp8_cache"])
def test_decode_steps_store_kv_inside_absorb_q_rope(kdev, tiny_ckpt, monkeypatch, fp8):
    """fp8: the cache in float8_e4m3fn (scale 0.37), compared byte for byte.
    bf16 decode-only steps of 1-2 tokens (batch 2; a verify of width 2) take absorb_q_rope_store_kv, the KV store
    inside absorb_q_rope's launch, in every layer; the hidden states and the cache equal the same steps with the
    store as its own kernel (the interpreter sums the norm in one order; on a GPU the rows may differ in the last
    bit, so there they are compared closely). The interpreter has no CUDA: head_gemv_serves is relaxed to any
    device."""
    from mlaserve.attention import triton_mla
    from mlaserve.attention.base import ForwardBatch, SeqChunk
    from mlaserve.config import ModelConfig
    from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
    from mlaserve.models.weights import load_weights
    from tests.helpers.kernel_checks import assert_close

    if kdev == "cpu":
        monkeypatch.setattr(triton_mla, "head_gemv_serves", lambda x, m, max_tokens=2: 1 <= x.shape[0] <= max_tokens)
    cfg = ModelConfig.from_pretrained(tiny_ckpt)
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.bfloat16, moe_impl="torch")
    load_weights(model, tiny_ckpt, progress=False)
    model.to(kdev).eval()
    fused = triton_mla.TritonMLABackend.absorb_q_rope_store_kv
    calls = []

    def run(use_fused: bool):
        def spy(self, *args, **kw):
            Q = fused(self, *args, **kw) if use_fused else None
            calls.append(Q is not None)
            return Q

        monkeypatch.setattr(triton_mla.TritonMLABackend, "absorb_q_rope_store_kv", spy)
        L = cfg.num_hidden_layers
        cache = torch.zeros(L, 4, 16, cfg.kv_cache_dim, dtype=torch.bfloat16, device=kdev)
        kw = {}
        if fp8:
            cache = cache.to(torch.float8_e4m3fn)
            kw = dict(kv_scale=torch.full((L,), 0.37, device=kdev), dtype=torch.bfloat16)
        attn = triton_mla.TritonMLABackend(cache, cfg.kv_lora_rank, num_splits=2, **kw)
        pages, hs = {0: [0], 1: [2, 1]}, []
        steps = [
            ([], [SeqChunk(list(range(5)), 0, pages[0]), SeqChunk(list(range(9, 29)), 0, pages[1])]),
            ([SeqChunk([7], 5, pages[0]), SeqChunk([8], 20, pages[1])], []),  # batch 2, one token each
            ([SeqChunk([3, 4], 21, pages[1])], []),
        ]  # a verify of width 2 at batch 1
        with torch.no_grad():
            for decode, prefill in steps:
                batch = ForwardBatch.build(decode, prefill, 16, kdev, attn)
                hs.append(model(batch.input_ids, batch.positions, batch))
        return hs, cache

    def same(a, b, what):
        if kdev == "cpu":
            assert torch.equal(a, b), what
        else:
            assert_close(a, b, torch.bfloat16, what)

    hs, cache = run(True)
    assert calls == [True] * 2 * cfg.num_hidden_layers, calls  # both decode steps, every layer; not the prefill
    hs2, cache2 = run(False)
    for step, (h, h2) in enumerate(zip(hs, hs2)):
        same(h, h2, f"hidden after step {step}")
    if not fp8:
        same(cache, cache2, "cache")
    elif kdev == "cpu":
        assert torch.equal(cache.view(torch.uint8), cache2.view(torch.uint8)), "fp8 cache"
    else:  # a bf16 row one unit apart (the norm's sum) may round to the neighbouring e4m3 value: one step, 2^-3
        torch.testing.assert_close(cache.float(), cache2.float(), rtol=2**-3, atol=2**-9)
