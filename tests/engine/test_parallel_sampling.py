"""n > 1 and best_of in the engine: the sequences share the prompt's full KV pages by reference (counted in the pool),
seeded choices are distinct and reproducible; min_tokens masks stop tokens; prompt logprobs equal the model's."""

import pytest

from mlaserve import LLM, SamplingParams
from tests.helpers.ref_sampling import model_logits

from .conftest import make_engine

PAGE = 16
PROMPT = list(range(3, 43))  # 40 tokens: 2 full pages are shareable (the last token is always computed)


def test_n_shares_prompt_pages(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_pages=64, page_size=PAGE, enable_prefix_caching=False)
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=4, ignore_eos=True)
    rid = eng.add_request(PROMPT, sp)
    peak, events = 0, []
    while eng.has_unfinished():
        events += eng.step()
        peak = max(peak, eng.pool.num_used)
        kids = [st.req for st in eng.states.values()]
        if len(kids) == 3 and all(k.pages for k in kids):
            shared = kids[0].pages[:2]
            assert all(k.pages[:2] == shared for k in kids) and all(eng.pool.ref[p] == 3 for p in shared)
    # 2 shared prompt pages + one page each for the rest (44 tokens): 5, not 3 x 3
    assert peak == 2 + 3
    outs = {}
    for e in events:
        assert e.request_id == rid
        outs.setdefault(e.index, []).extend(e.new_token_ids)
    assert sorted(outs) == [0, 1, 2] and len({tuple(v) for v in outs.values()}) == 3
    assert events[-1].usage.prompt_tokens == 40 and events[-1].usage.completion_tokens == 12


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, device="cpu", num_pages=128, page_size=PAGE)


def test_seeded_choices_reproducible_and_seed_plus_index(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    a = [c.token_ids for c in llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs]
    b = [c.token_ids for c in llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs]
    assert a == b and len({tuple(x) for x in a}) == 3
    for i in range(3):  # choice i samples as a single request seeded seed + i (vLLM)
        one = SamplingParams(temperature=1.0, seed=5 + i, max_tokens=6, ignore_eos=True)
        assert llm.generate([PROMPT], one, use_tqdm=False)[0].token_ids == a[i]


def test_best_of_returns_highest_cumulative_logprob(llm):
    sp = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, logprobs=0)
    outs = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs
    every = SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, logprobs=0)
    all5 = llm.generate([PROMPT], every, use_tqdm=False)[0].outputs
    ranked = sorted(all5, key=lambda c: -sum(c.logprobs))
    assert [c.token_ids for c in outs] == [c.token_ids for c in ranked[:2]]
    assert outs[0].cumulative_logprob >= outs[1].cumulative_logprob


def test_min_tokens_masks_stop_tokens(llm):
    first = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].token_ids[0]
    stop = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first])
    assert llm.generate([PROMPT], stop, use_tqdm=False)[0].token_ids == [first]
    held = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=3)
    ids = llm.generate([PROMPT], held, use_tqdm=False)[0].token_ids
    assert len(ids) >= 3 and first not in ids[:3]


def test_prompt_logprobs_equal_model_log_softmax(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    ref = model_logits(llm.engine, PROMPT).log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[i]
        assert entry[PROMPT[i]] == pytest.approx(ref[i - 1, PROMPT[i]].item(), abs=1e-4)
        top = ref[i - 1].topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t] == pytest.approx(v, abs=1e-4)


def test_top_logprobs_equal_model_log_softmax(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=5), use_tqdm=False)[0]
    c = out.outputs[0]
    ref = model_logits(llm.engine, PROMPT + c.token_ids).log_softmax(-1)[len(PROMPT) - 1 : -1]
    for j, top in enumerate(c.top_logprobs):
        want = ref[j].topk(5)
        assert list(top) == want.indices.tolist()
        assert list(top.values()) == pytest.approx(want.values.tolist(), abs=1e-4)
        assert c.logprobs[j] == pytest.approx(ref[j, c.token_ids[j]].item(), abs=1e-4)
