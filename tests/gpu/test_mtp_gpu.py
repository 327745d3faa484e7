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
    from tests.helpers.engine_drive import drafts_by_length

    spec = {"algorithm": "MTP", "num_steps": k}
    llm = LLM(ckpt, device="cuda", speculative_config=spec, num_pages=2048, page_size=64, enforce_eager=eager, **kw)
    sp = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    out, log = drafts_by_length(llm.engine, _prompts(), sp)
    st = llm.engine.stats()
    llm.close()
    return out, log, st


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
