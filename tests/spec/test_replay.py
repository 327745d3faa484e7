"""The benchmark-only REPLAY draft: recorded greedy outputs proposed with seeded deliberate misses. Outputs stay the
plain engine's; the acceptance per draft position is exactly what the misses imply."""

import random

import pytest

from mlaserve.args import engine_kwargs_from_args
from mlaserve.cli import build_parser
from mlaserve.config import EngineConfig, SpecConfig
from mlaserve.engine.engine import LLMEngine
from mlaserve.models.make_random_draft import make_random_draft
from mlaserve.spec.replay import is_miss, prompt_key, write_recordings
from mlaserve.types import SamplingParams

MAX = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)


def _prompts(n=6, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def run(engine, prompts):
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    events = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            events[o.request_id].append(o)
    return [events[r] for r in rids]


def tokens(evs):
    return [t for e in evs for t in e.new_token_ids]


@pytest.fixture(scope="module")
def recorded(tiny_ckpt, tmp_path_factory):
    """(prompts, plain greedy outputs, the recording file)."""
    prompts = _prompts()
    outs = [tokens(e) for e in run(LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu")), prompts)]
    path = str(tmp_path_factory.mktemp("rec") / "replay.jsonl")
    assert write_recordings(path, zip(prompts, outs)) == len(prompts)
    return prompts, outs, path


def expected_per_position(prompt, k: int, rate: float, seed: int, max_tokens: int = MAX) -> list[int]:
    """Replays the chain rule on the misses alone: each step proposes output indexes n .. n+k-1, accepts up to the
    first miss, and emits 1 + accepted tokens, cut at max_tokens."""
    counts, n, key = [0] * k, 1, prompt_key(prompt)  # the prefill emitted output 0
    while n < max_tokens:
        a = 0
        while a < k and n + a < max_tokens and not is_miss(seed, key, n + a, rate):
            a += 1
        emitted = min(1 + a, max_tokens - n)
        for i in range(emitted - 1):
            counts[i] += 1
        n += emitted
    return counts


def replay_engine(ckpt, path, k, rate, seed=0, draft=None):
    kw = dict(replay_path=path, replay_miss_rate=rate, replay_seed=seed, draft_model=draft)
    spec = SpecConfig.from_dict(dict(algorithm="REPLAY", num_steps=k, **kw))
    return LLMEngine(EngineConfig(model=ckpt, device="cpu"), spec=spec)


@pytest.mark.parametrize("k,rate", [(1, 0.0), (3, 0.0), (2, 1.0), (3, 0.5), (2, 0.3)])
def test_replay_acceptance_is_exactly_the_misses(tiny_ckpt, recorded, k, rate):
    prompts, outs, path = recorded
    eng = replay_engine(tiny_ckpt, path, k, rate, seed=7)
    got = run(eng, prompts)
    assert [tokens(e) for e in got] == outs
    want = [expected_per_position(p, k, rate, 7) for p in prompts]
    assert [list(e[-1].usage.spec_accepted_per_position) for e in got] == want
    assert eng.stats()["spec_accepted_per_position"] == [sum(c[i] for c in want) for i in range(k)]
    assert all(t.recorded is not None for t in eng.proposer.tracks.values())  # no output left its recording
    if rate == 0.0:
        assert all(len(e.new_token_ids) == k + 1 for evs in got for e in evs[1:-1])


def test_replay_with_the_draft_model_running(tiny_ckpt, recorded, tmp_path):
    """With a draft model the EAGLE3 forward runs each step; the tokens, and so the counts, are the replay's."""
    prompts, outs, path = recorded
    draft = make_random_draft("tiny-eagle3", str(tmp_path / "d"), target=tiny_ckpt, dtype="float32")
    eng = replay_engine(tiny_ckpt, path, 2, 0.4, seed=1, draft=draft)
    calls = []
    inner = eng.proposer.inner.propose
    eng.proposer.inner.propose = lambda chunks: calls.append(len(chunks)) or inner(chunks)
    got = run(eng, prompts)
    assert [tokens(e) for e in got] == outs and calls
    want = [expected_per_position(p, 2, 0.4, 1) for p in prompts]
    assert [list(e[-1].usage.spec_accepted_per_position) for e in got] == want


def test_unrecorded_prompt_falls_back_and_keeps_outputs(tiny_ckpt, recorded):
    prompts, outs, path = recorded
    eng = replay_engine(tiny_ckpt, path, 2, 0.0)
    other = [[5, 6, 7, 8]]
    ref = [tokens(e) for e in run(LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu")), other)]
    assert [tokens(e) for e in run(eng, other)] == ref
    assert eng.proposer.unrecorded_tokens > 0


def test_replay_seed_changes_where_it_misses(recorded):
    prompts = recorded[0]
    a = [expected_per_position(p, 3, 0.5, 1) for p in prompts]
    b = [expected_per_position(p, 3, 0.5, 2) for p in prompts]
    assert a != b
    misses = sum(is_miss(0, prompt_key(p), j, 0.3) for p in prompts for j in range(200))
    assert abs(misses / (200 * len(prompts)) - 0.3) < 0.03


@pytest.mark.parametrize(
    "d,field",
    [
        (dict(algorithm="REPLAY"), "replay_path"),
        (dict(algorithm="REPLAY", replay_path="/nonexistent.jsonl"), "replay_path"),
        (dict(algorithm="EAGLE3", draft_model=None), "draft_model"),
        (dict(algorithm="MEDUSA", draft_model="x"), "algorithm"),
    ],
)
def test_replay_config_errors(d, field):
    with pytest.raises(ValueError, match=f"speculative_config.{field}"):
        SpecConfig.from_dict(d)


def test_replay_config_miss_rate_and_eagle3_path(recorded, tmp_path):
    path = recorded[2]
    with pytest.raises(ValueError, match="replay_miss_rate: must be in"):
        SpecConfig.from_dict(dict(algorithm="REPLAY", replay_path=path, replay_miss_rate=1.5))
    with pytest.raises(ValueError, match="replay_path: only the REPLAY"):
        SpecConfig.from_dict(dict(algorithm="EAGLE3", draft_model=str(tmp_path), replay_path=path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1]}\n')
    with pytest.raises(ValueError, match="line 1"):
        from mlaserve.spec.replay import read_recordings

        read_recordings(str(bad))


def test_cli_flags(recorded):
    path = recorded[2]
    argv = ["generate", "--prompt", "x", "--speculative-algorithm", "REPLAY", "--speculative-num-steps", "3"]
    argv += ["--speculative-replay-path", path, "--speculative-replay-miss-rate", "0.25"]
    argv += ["--speculative-replay-seed", "4"]
    kw = engine_kwargs_from_args(build_parser(argv).parse_args(argv))
    spec = SpecConfig.from_dict(kw["speculative_config"])
    assert spec.is_replay and spec.num_draft_tokens == 4 and spec.draft_model is None
    assert (spec.replay_path, spec.replay_miss_rate, spec.replay_seed) == (path, 0.25, 4)


def test_help_labels_replay_benchmark_only(capsys):
    with pytest.raises(SystemExit):
        build_parser(["serve", "--help"]).parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "REPLAY is a benchmark-only draft" in text and "REPLAY (benchmark only)" in text
