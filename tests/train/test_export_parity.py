"""The training model's HF export loads in mlaserve and in transformers' DeepseekV3ForCausalLM, and all three
give the same logits (fp32, CPU); the grouped expert path equals the per-expert loop."""

import pytest
import torch

from mlaserve.train.experts import experts_forward, route
from mlaserve.train.export import export_hf
from mlaserve.train.model_config import param_count

from ..model.helpers import RefRunner, load_model
from .helpers import random_model, tiny_config


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from mlaserve.tokenizer import write_byte_level_tokenizer

    tok = str(tmp_path_factory.mktemp("tok"))
    write_byte_level_tokenizer(tok, 512, 0, 1)
    model = random_model(tiny_config())
    out = export_hf(model, tok, str(tmp_path_factory.mktemp("hf")), dtype="float32")
    return model, out


def ids(n, seed=0):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(got, ref, rel=1e-4):
    assert got.shape == ref.shape and torch.isfinite(got).all()
    diff, tol = (got - ref).abs().max().item(), rel * ref.abs().max().item()
    assert diff <= tol, f"max |logit diff| {diff:.3g} > {tol:.3g}"


@torch.no_grad()
def train_logits(model, prompt):
    h, _ = model.hidden(torch.tensor([prompt]))
    return model.lm_head(h)[0]


def test_param_count_matches_the_checkpoint(exported):
    model, _ = exported
    n = sum(t.numel() for t in model.hf_state_dict().values())
    assert n == param_count(model.config)


@pytest.mark.parametrize("n", [1, 7, 40])
def test_mlaserve_logits_equal(exported, n):
    model, path = exported
    _, (logits,) = RefRunner(load_model(path)).prefill([ids(n, n)])
    close(logits, train_logits(model, ids(n, n)))


@pytest.mark.parametrize("n", [1, 7, 40])
def test_transformers_logits_equal(exported, n):
    from ..model.hf_ref import hf_logits, hf_model

    model, path = exported
    close(hf_logits(hf_model(path), ids(n, n)), train_logits(model, ids(n, n)))


def test_grouped_mm_equals_the_loop():
    """torch._grouped_mm (bf16) where this torch runs it on the CPU; else the GPU test covers it."""
    g = torch.Generator().manual_seed(0)
    T, D, E, I, K = 37, 64, 8, 32, 2
    x = torch.randn(T, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, D, generator=g) / 8).bfloat16()
    w2 = (torch.randn(E, D, I, generator=g) / 6).bfloat16()
    weights, sel = route(torch.randn(T, E, generator=g), torch.zeros(E), K, True, 1.0)
    ref = experts_forward(x, w13, w2, weights, sel, grouped=False)
    try:
        got = experts_forward(x, w13, w2, weights, sel, grouped=True)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run on this CPU build ({e})")
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
