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


def test_chat_renders_each_conversation_and_generates(tiny_ckpt):
    """LLM.chat, as vLLM's: one conversation or several through the chat template, the same tokens as generate() on
    the rendered text; continue_final_message leaves the last message open; the prompt ids are those that ran
    (truncate_prompt_tokens)."""
    llm = LLM(tiny_ckpt, device="cpu", num_pages=128, page_size=16)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    conv = [{"role": "user", "content": "hello"}]
    one = llm.chat(conv, sp, use_tqdm=False)
    text = llm.tokenizer.apply_chat_template(conv)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert one[0].prompt == text and one[0].prompt_token_ids == ids
    assert one[0].token_ids == llm.generate([ids], sp, use_tqdm=False)[0].token_ids
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]], sp, False)
    assert two[0].token_ids == one[0].token_ids and two[1].prompt.endswith("y<|im_end|>\n<|im_start|>assistant\n")
    prefilled = llm.chat(conv + [{"role": "assistant", "content": "Hi, I am"}], sp, False, continue_final_message=True)
    assert prefilled[0].prompt.endswith("assistant\nHi, I am")
    want = llm.generate([llm.tokenizer.encode(prefilled[0].prompt, add_special_tokens=False)], sp, use_tqdm=False)
    assert prefilled[0].token_ids == want[0].token_ids
    cut = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0, truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-4:] and cut.usage.prompt_tokens == 4
    llm.close()
