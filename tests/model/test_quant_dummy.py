"""--load-format dummy on a quantized config: weights made in place in the checkpoint layouts (no files), whose
dequantized values have make-random's spread, and a model that generates varied tokens."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.config import ModelConfig
from mlaserve.layers.fp8_linear import Fp8Linear
from mlaserve.layers.quant import dequant_fp8_block
from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from mlaserve.models.dummy_weights import init_dummy_weights
from mlaserve.models.make_random import make_random
from tests.helpers.quant_ckpt import FP8_ODD

from .helpers import load_model


@pytest.fixture(scope="module", params=["int4-experts", "fp8-block"])
def config_only(request, tmp_path_factory):
    dims = FP8_ODD if request.param == "fp8-block" else {}
    out = str(tmp_path_factory.mktemp(request.param))
    return make_random("tiny", out, dtype="float32", quantization=request.param, config_only=True, overrides=dims)


def test_same_layouts_as_a_loaded_checkpoint(config_only, int4_ckpt, fp8_ckpt):
    cfg = ModelConfig.from_pretrained(config_only)
    dummy = DeepseekV3ForCausalLM(cfg)
    init_dummy_weights(dummy, seed=1)
    loaded = load_model(int4_ckpt if cfg.quantization.method == "int4" else fp8_ckpt)
    want = {n: (p.dtype, p.shape) for n, p in loaded.named_parameters()}
    assert {n: (p.dtype, p.shape) for n, p in dummy.named_parameters()} == want
    for n, p in dummy.named_parameters():
        if p.dtype != torch.int32:
            assert torch.isfinite(p.float()).all(), n
    experts = dummy.model.layers[1].mlp.experts
    w13, w2 = experts.dequant(0)
    assert w13.std().item() == pytest.approx(1 / cfg.hidden_size**0.5, rel=0.2)
    assert w2.std().item() == pytest.approx(0.5 / cfg.moe_intermediate_size**0.5, rel=0.2)
    if cfg.quantization.method == "fp8":
        o = dummy.model.layers[0].self_attn.o_proj
        assert isinstance(o, Fp8Linear)
        w = dequant_fp8_block(o.weight, o.weight_scale_inv)
        assert w.std().item() == pytest.approx(0.5 / o.weight.shape[1] ** 0.5, rel=0.2)


def test_llm_generates_on_dummy_quantized_weights(config_only):
    llm = LLM(config_only, device="cpu", load_format="dummy")
    outs = llm.generate([[1, 2, 3], [7, 8, 9, 10]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for o in outs:
        assert len(set(o.token_ids)) >= 8, o.token_ids
    assert llm.weight_bytes[0].quantized > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dummy_router_weights_are_what_a_checkpoint_stores(dtype, tmp_path):
    # A checkpoint stores the router weight in the model dtype (make-random too); the model holds it in fp32. Dummy
    # weights must be as exact in bf16, so that the bf16 router paths run on them as on loaded weights.
    cfg = ModelConfig.from_pretrained(make_random("tiny", str(tmp_path), dtype="float32", config_only=True))
    model = DeepseekV3ForCausalLM(cfg, dtype=dtype)
    init_dummy_weights(model, seed=3)
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert routers
    for r in routers:
        assert r.weight.dtype == torch.float32 and r.weight.std().item() > 0
        assert torch.equal(r.weight.to(torch.bfloat16).float(), r.weight) == (dtype == torch.bfloat16)
        assert (r.bf16_weight() is not None) == (dtype == torch.bfloat16)
