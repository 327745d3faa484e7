"""On a GPU: the grammar bitmask applied in torch equals xgrammar's own CUDA kernel and the CPU path; a greedy
json_schema request through the CUDA-graph engine takes the model's arg-max over exactly the allowed tokens and
validates, and the plain greedy requests beside it keep the tokens they get alone."""

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
}


@pytest.mark.parametrize("V", [512, 129280, 163840])
def test_bitmask_matches_xgrammar_cuda_kernel(gpu_seed, V):
    xgr = pytest.importorskip("xgrammar")
    from mlaserve.layers.grammar_mask import apply_bitmask

    B, W = 8, (V + 31) // 32
    bitmask = torch.randint(-(1 << 31), 1 << 31, (B, W), dtype=torch.int64).to(torch.int32)
    logits = torch.randn(B, V)
    cpu = logits.clone()
    apply_bitmask(cpu, list(range(B)), bitmask, logits)
    ref = logits.cuda()
    xgr.apply_token_bitmask_inplace(ref, bitmask.cuda())
    ours = torch.full((B, V), float("nan"), device="cuda")
    ours.copy_(logits.cuda())
    apply_bitmask(ours, list(range(B)), bitmask.cuda(), logits.cuda())
    torch.cuda.synchronize()
    assert torch.equal(ours, ref) and torch.equal(ours.cpu(), cpu)


def test_json_schema_greedy_on_cuda_graphs(tiny_ckpt):
    xgr = pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    from mlaserve import LLM, SamplingParams, StructuredOutput
    from mlaserve.layers.grammar_mask import allowed_tokens
    from tests.helpers.ref_sampling import model_logits

    llm = LLM(tiny_ckpt, device="cuda", num_pages=512, page_size=64)
    eng = llm.engine
    plain = [[5, 6, 7, 8], [100, 101, 102]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(plain, greedy, use_tqdm=False)]
    so = StructuredOutput("json", json.dumps(SCHEMA), field="response_format")
    prompt = [40, 41, 42, 43]
    params = [SamplingParams(temperature=0, max_tokens=40, structured=so), greedy, greedy]
    outs = llm.generate([prompt] + plain, params, use_tqdm=False)
    assert [o.token_ids for o in outs[1:]] == alone
    ids = outs[0].token_ids
    assert ids[-1] in eng.eos_token_ids
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    logits = model_logits(eng, prompt + ids[:-1])[len(prompt) - 1 :]
    matcher = xgr.GrammarMatcher(eng.grammars.compile(so))
    V = logits.shape[1]
    bm = torch.empty(1, (V + 31) // 32, dtype=torch.int32)
    for i, t in enumerate(ids):
        matcher.fill_next_token_bitmask(bm, 0)
        allowed = allowed_tokens(bm.cuda(), V)[0]
        assert int(logits[i].masked_fill(~allowed, float("-inf")).argmax()) == t, f"token {i}"
        assert matcher.accept_token(t)


def test_grammar_after_the_end_of_reasoning_on_cuda_graphs(tiny_ckpt):
    """after_token_ids (a thinking model's forced tool call): free greedy tokens until the end token, equal to plain
    greedy decoding, then the JSON under the grammar."""
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    from mlaserve import LLM, SamplingParams, StructuredOutput

    llm = LLM(tiny_ckpt, device="cuda", num_pages=512, page_size=64)
    eng = llm.engine
    prompt = [40, 41, 42, 43]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    plain = plain[0].token_ids
    end = next(t for t in range(258, 300) if t not in plain and t not in eng.eos_token_ids)
    so = StructuredOutput("json", json.dumps(SCHEMA), field="tool_choice", after_token_ids=(end,))
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, structured=so)
    ended = SamplingParams(temperature=0, max_tokens=40, logit_bias={end: 100.0}, structured=so)
    outs = llm.generate([prompt, prompt], [free, ended], use_tqdm=False)
    assert outs[0].token_ids == plain
    ids = outs[1].token_ids
    assert ids[0] == end and ids[-1] in eng.eos_token_ids
    jsonschema.validate(json.loads(eng.tokenizer.decode(ids[1:-1])), SCHEMA)


@pytest.mark.parametrize("k,rate", [(1, 0.0), (3, 0.0), (3, 0.3)])
def test_json_schema_under_speculation(tiny_ckpt, tmp_path, k, rate):
    """Structured output on a speculative CUDA-graph engine (REPLAY proposing plain decoding's structured outputs):
    verify row i masked after the first i drafts gives plain's tokens, with exactly the acceptance the misses imply;
    greedy plain requests beside them keep overlapping and their tokens."""
    pytest.importorskip("xgrammar")
    from mlaserve import LLM, SamplingParams, StructuredOutput
    from mlaserve.spec.replay import write_recordings
    from tests.spec.test_replay import expected_per_position

    so = StructuredOutput("json", json.dumps(SCHEMA), field="response_format")
    prompts = [[40, 41, 42, 43], [44, 45], [5, 6, 7, 8]]
    params = [SamplingParams(temperature=0, max_tokens=40, structured=so)] * 2
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    kw = dict(device="cuda", num_pages=512, page_size=64)
    llm = LLM(tiny_ckpt, **kw)
    plain = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(p[-1] in llm.engine.eos_token_ids for p in plain[:2])
    llm.close()
    path = str(tmp_path / "rec.jsonl")
    write_recordings(path, zip(prompts, plain))
    spec = dict(algorithm="REPLAY", num_steps=k, replay_path=path, replay_miss_rate=rate)
    llm = LLM(tiny_ckpt, speculative_config=spec, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    got = [list(o.usage.spec_accepted_per_position) for o in outs]
    assert got == [expected_per_position(p, k, rate, 0, max_tokens=len(o)) for p, o in zip(prompts, plain)]
    llm.close()
