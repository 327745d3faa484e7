"""Simulated acceptance (SpecConfig.simulate_acceptance, benchmark only): each draft position is accepted with a set
probability whatever the target computes, so the speed of speculative decoding at that acceptance is measured at any
context on the real paths (the device step, the overlap, the draft). At 0 the outputs are plain greedy's; at 1 every
step emits K + 1 tokens; in between the text stays causal (every token not taken from an accepted draft is the
target's greedy token after the text before it) and the measured acceptance is about the one set."""

import math

import pytest
import torch

from mlaserve.config import SpecConfig
from mlaserve.server.api import speculative_card
from mlaserve.spec.verify import simulate_accept
from mlaserve.types import SamplingParams

from .conftest import make_engine
from .test_spec_device_path import GREEDY, MAX, _prompts, draft, plain  # noqa: F401 (fixtures)


def _spec(draft_dir, k, a, seed=0):
    return SpecConfig.from_dict(dict(draft_model=draft_dir, num_steps=k, simulate_acceptance=a, replay_seed=seed))


def _run(eng, prompts, late=0):
    """-> outputs; `late` requests arrive after two steps (their prefill shares steps with verifies)."""
    rids = [eng.add_request(p, GREEDY) for p in prompts[: len(prompts) - late]]
    out = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        if steps == 2 and late:
            rids += [eng.add_request(p, GREEDY) for p in prompts[len(prompts) - late :]]
    return [out[r] for r in rids]


def test_simulate_accept_rule():
    y = torch.tensor([[10, 11, 12], [20, 21, 22]])
    drafts = torch.tensor([[7, 8], [9, 6]])
    g = torch.Generator().manual_seed(0)
    e, a = simulate_accept(y, drafts, 1.0, g)
    assert a.tolist() == [2, 2] and e.tolist() == [[7, 8, 12], [9, 6, 22]]
    e, a = simulate_accept(y, drafts, 0.0, g)
    assert a.tolist() == [0, 0] and e.tolist() == y.tolist()


@pytest.mark.parametrize("k", [1, 3])
def test_zero_acceptance_is_plain_greedy(tiny_ckpt, draft, plain, k):  # noqa: F811
    eng = make_engine(tiny_ckpt, spec=_spec(draft, k, 0.0), page_size=4, max_num_seqs=8)
    assert _run(eng, _prompts(8), late=3) == plain
    st = eng.stats()
    assert st["spec_accepted_tokens"] == 0 and st["spec_device_steps"] > 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_full_acceptance_emits_k_plus_one_a_step(tiny_ckpt, draft, k):  # noqa: F811
    eng = make_engine(tiny_ckpt, spec=_spec(draft, k, 1.0), page_size=4, max_num_seqs=8)
    outs = _run(eng, _prompts(8))
    assert all(len(o) == MAX for o in outs)
    st = eng.stats()
    # the first token comes from the prefill; each verify after it emits K + 1 (the last one up to max_tokens)
    assert st["spec_steps"] == 8 * math.ceil((MAX - 1) / (k + 1)), st
    assert st["spec_device_steps"] > 0


def test_partial_acceptance_keeps_the_text_causal(tiny_ckpt, draft):  # noqa: F811
    k, a = 2, 0.5
    prompts = _prompts(8, seed=1)
    eng = make_engine(tiny_ckpt, spec=_spec(draft, k, a, seed=5), page_size=4, max_num_seqs=8)
    outs = _run(eng, prompts, late=2)
    st = eng.stats()
    first = st["spec_accepted_per_position"][0] / st["spec_steps"]
    assert 0.3 < first < 0.7, st  # ~100 draws at 0.5
    # teacher-forced: a token that is not the target's greedy successor of the text before it was an accepted draft
    ref = make_engine(tiny_ckpt, page_size=4, max_num_seqs=8)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rids = [(ref.add_request(p + o[:i], one), o[i]) for p, o in zip(prompts, outs) for i in range(MAX)]
    got = {}
    while ref.has_unfinished():
        for ev in ref.step():
            got.setdefault(ev.request_id, []).extend(ev.new_token_ids)
    off = sum(got[r][0] != t for r, t in rids)
    # a request's last step, cut by max_tokens to m <= accepted tokens, counts m - 1 accepted: at most one more each
    assert 0 < off <= st["spec_accepted_tokens"] + len(prompts), (off, st["spec_accepted_tokens"])


def test_config_errors_and_card(draft, tmp_path):  # noqa: F811
    for bad in (1.5, -0.1, True, "x"):
        with pytest.raises(ValueError, match="simulate_acceptance: must be in"):
            SpecConfig.from_dict(dict(draft_model=draft, simulate_acceptance=bad))
    rec = tmp_path / "r.jsonl"
    rec.write_text('{"prompt_token_ids": [1], "output_token_ids": [2]}\n')
    with pytest.raises(ValueError, match="simulate_acceptance: for EAGLE3 only"):
        SpecConfig.from_dict(dict(algorithm="REPLAY", replay_path=str(rec), simulate_acceptance=0.5))
    card = speculative_card(_spec(draft, 1, 0.7))
    assert card["benchmark_only"] and card["simulate_acceptance"] == 0.7
    assert not speculative_card(SpecConfig.from_dict(dict(draft_model=draft)))["benchmark_only"]


def test_cli_flag(draft):  # noqa: F811
    from mlaserve.args import engine_kwargs_from_args
    from mlaserve.cli import build_parser

    argv = ["generate", "--prompt", "x", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft]
    argv += ["--speculative-simulate-acceptance", "0.7", "--speculative-replay-seed", "3"]
    kw = engine_kwargs_from_args(build_parser(argv).parse_args(argv))
    spec = SpecConfig.from_dict(kw["speculative_config"])
    assert (spec.simulate_acceptance, spec.replay_seed, spec.is_replay) == (0.7, 3, False)
