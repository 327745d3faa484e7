"""LLM.close(): the engine goes (weights, KV cache, graphs), so another LLM can start in the same process; a GPU's
memory goes back with it."""

import weakref

from mlaserve.llm import LLM
from mlaserve.types import SamplingParams


def test_close_frees_the_engine(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="cpu")
    want = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].token_ids
    model, kv = weakref.ref(llm.engine.runner.model), weakref.ref(llm.engine.runner.kv_cache)
    llm.close()
    assert llm.engine is None and model() is None and kv() is None
    llm.close()  # twice is harmless
    again = LLM(tiny_ckpt, device="cpu")
    assert again.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].token_ids == want
    again.close()
