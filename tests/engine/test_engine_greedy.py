"""The engine's greedy output equals transformers' generate(), also under small chunks and preemption."""

import random

import pytest
import torch

from .conftest import make_engine, run_all

MAX_NEW = 8
LENGTHS = [1, 2, 3, 5, 8, 13, 17, 31, 32, 33, 64, 100, 150, 200, 257, 300]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1234)
    return [[rng.randrange(512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_greedy(tiny_ckpt, prompts):
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = hf.generate(
                ids,
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
                pad_token_id=0,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs


def _generate(engine, prompts):
    from mlaserve.types import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    rids = [engine.add_request(p, sp) for p in prompts]
    got = run_all(engine)
    return [got[r] for r in rids]


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(chunked_prefill_size=32, max_num_batched_tokens=64),
        dict(num_pages=20, page_size=16, max_num_batched_tokens=512),
    ],
    ids=["default", "chunked32", "preempt"],
)
def test_greedy_matches_transformers(tiny_ckpt, prompts, hf_greedy, kw):
    engine = make_engine(tiny_ckpt, **kw)
    got = _generate(engine, prompts)
    for i, (a, b) in enumerate(zip(got, hf_greedy)):
        assert a == b, f"prompt {i} (len {len(prompts[i])}): mlaserve {a} != transformers {b}"
    if "num_pages" in kw:
        assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
