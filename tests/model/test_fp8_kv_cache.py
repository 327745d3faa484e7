"""The FP8 latent KV cache on the torch reference backend (--kv-cache-dtype fp8): the same model reads back
an e4m3 copy of every latent row, in prefill (its context) and in absorbed decode."""

import pytest
import torch

from mlaserve.attention.kv_fp8 import FP8_KV_MAX, dequantize_kv, quantize_kv
from mlaserve.attention.torch_ref import TorchRefBackend

from .helpers import RefRunner, load_model, make_tiny

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [300, 17, 99], list(range(100, 130))]
FP8 = torch.float8_e4m3fn


class RoundTripBackend(TorchRefBackend):
    """The reference with a cache in the model's dtype whose stored rows went through quantize_kv / dequantize_kv
    with one scale: what an FP8 cache must read back, element for element."""

    def __init__(self, kv_cache, kv_lora_rank, scale: float):
        super().__init__(kv_cache, kv_lora_rank)
        self.scale = torch.tensor(scale)

    def store_kv(self, layer_id, c_kv, k_pe, cos, sin, batch, norm=None):
        super().store_kv(layer_id, c_kv, k_pe, cos, sin, batch, norm)
        ok = batch.slot_mapping >= 0
        cache = self.kv_cache[layer_id].view(-1, self.kv_cache.shape[-1])
        rows = cache[batch.slot_mapping[ok]]
        cache[batch.slot_mapping[ok]] = dequantize_kv(quantize_kv(rows, self.scale), self.scale, rows.dtype)


def logits(runner: RefRunner) -> torch.Tensor:
    """Prefill logits of every prompt in chunks of 5 (later chunks read earlier ones from the cache), then 6
    decode steps: [rows, vocab]."""
    seqs, prefill = runner.prefill(PROMPTS, chunk=5)
    decode = [torch.cat(runner.step(decode=[(s, [(7 * j + b) % 512]) for b, s in enumerate(seqs)])) for j in range(6)]
    return torch.cat(prefill + decode)


def test_quantize_saturates_and_dequantize_applies_the_scale():
    x = torch.tensor([1000.0, -1000.0, 0.3, 0.0, -2.5])
    s = torch.tensor(0.5)
    q = quantize_kv(x, s)
    assert q.dtype == FP8 and torch.isfinite(q.float()).all()
    assert q.float()[:2].tolist() == [FP8_KV_MAX, -FP8_KV_MAX]  # saturated, not NaN
    assert dequantize_kv(q, s, torch.float32)[2:].tolist() == [0.3125, 0.0, -2.5]  # 0.6 rounds to 0.625 (e4m3)


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fp8_cache_equals_a_reference_quantizing_the_latent_the_same_way(tmp_path, scale):
    """Exact: an fp32 model with an FP8 cache against the same model whose fp32 cache holds the dequantized rows."""
    path = make_tiny(tmp_path, seed=3)
    fp8 = logits(RefRunner(load_model(path), cache_dtype=FP8, kv_scale=scale))
    ref = logits(RefRunner(load_model(path), backend=lambda c, r: RoundTripBackend(c, r, scale)))
    assert torch.equal(fp8, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_cache_close_to_the_model_dtype_cache(tmp_path, dtype):
    """e4m3 keeps 3 mantissa bits: each cached element is rounded by up to 2^-4 of itself (bf16: 2^-8). The errors
    of independent elements partly cancel in attention's sums, so the logits move by about one element's error:
    bounded here by 10 % of the row's largest logit at every position and 5 % at the median (the dense tiny model,
    so no routing tie flips an expert), with the same greedy token almost everywhere."""
    path = make_tiny(tmp_path, seed=5, first_k_dense_replace=3)
    base = logits(RefRunner(load_model(path, dtype)))
    fp8 = logits(RefRunner(load_model(path, dtype), cache_dtype=FP8))
    assert torch.isfinite(fp8).all()
    err = (fp8.float() - base.float()).abs().amax(-1) / base.float().abs().amax(-1)
    assert err.max() < 0.10 and err.median() < 0.05, err
    assert (fp8.argmax(-1) == base.argmax(-1)).float().mean() >= 0.9


def test_fp8_cache_holds_e4m3_rows_and_the_backend_needs_its_scales():
    cache = torch.zeros(2, 4, 4, 8, dtype=FP8)
    with pytest.raises(ValueError, match=r"FP8 KV cache needs kv_scale \[2\]"):
        TorchRefBackend(cache, 6)
    with pytest.raises(ValueError, match=r"FP8 KV cache needs kv_scale \[2\]"):
        TorchRefBackend(cache, 6, torch.ones(3), torch.bfloat16)
    assert TorchRefBackend(cache, 6, torch.ones(2), torch.bfloat16).fp8
