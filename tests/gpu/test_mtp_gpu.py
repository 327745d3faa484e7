"""On a GPU, under CUDA graphs: MTP speculation (the checkpoint's MTP layer as the draft) keeps greedy equal to plain
for K = 1 and 2 with the draft's captured step (inside the speculative step graph), and drafts after every step what
the eager engine drafts; an FP8 checkpoint's MTP layer (FP8 kernels, fp32 activations) keeps its plain greedy too."""

import pytest

from .test_spec_gpu import MAX, _greedy, _prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    from mlaserve.models.make_random import make_random

    return make_random("tiny", str(tmp_path_factory.mktemp("mtp")), seed=0, dtype="float32", progress=False, mtp=True)


def _drafts_by_length(ckpt, k, eager, **kw):
    from mlaserve import LLM, SamplingParams

    llm = LLM(
        ckpt,
        device="cuda",
        speculative_config={"algorithm": "MTP", "num_steps": k},
        num_pages=2048,
        page_size=64,
        enforce_eager=eager,
        **kw,
    )
    eng, log = llm.engine, {}
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)) for p in _prompts()]
    out = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        for r in eng.scheduler.running:  # a request's drafts keyed by its length: free of step timing
            if r.request_id in eng.states:
                log.setdefault((rids.index(r.request_id), r.num_tokens), list(eng.states[r.request_id].drafts))
    st = eng.stats()
    llm.close()
    return [out[r] for r in rids], log, st


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_under_graphs_keeps_greedy_and_drafts_like_eager(mtp_ckpt, k):
    plain = _greedy(mtp_ckpt, _prompts())[0]
    got, _, llm, draft_runs = _greedy(mtp_ckpt, _prompts(), {"algorithm": "MTP", "num_steps": k})
    assert got == plain
    assert llm.engine.spec_step_graphs is not None and sum(draft_runs) > 0
    llm.close()
    out_e, d_eager, st_e = _drafts_by_length(mtp_ckpt, k, True, dtype="float32")
    out_g, d_graph, st_g = _drafts_by_length(mtp_ckpt, k, False, dtype="float32")
    assert out_e == out_g == plain
    assert st_g["spec_device_steps"] > 0 and st_e["spec_device_steps"] == 0
    diff = sorted(x for x in d_eager.keys() | d_graph.keys() if d_eager.get(x) != d_graph.get(x))
    assert not diff, [(x, d_eager.get(x), d_graph.get(x)) for x in diff[:8]]


def test_fp8_mtp_layer_keeps_greedy(tmp_path):
    from mlaserve.models.make_random import make_random
    from tests.helpers.quant_ckpt import FP8_ODD_TRITON

    path = make_random(
        "tiny",
        str(tmp_path),
        seed=0,
        dtype="float32",
        progress=False,
        quantization="fp8-block",
        overrides=FP8_ODD_TRITON,
        mtp=True,
    )
    plain = _greedy(path, _prompts())[0]
    got, _, llm, draft_runs = _greedy(path, _prompts(), {"algorithm": "MTP", "num_steps": 2})
    assert got == plain and sum(draft_runs) > 0
    llm.close()
