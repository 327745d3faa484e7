"""A step's chunks as one int32 tensor (engine/step_broadcast.py): the codec round-trips every field, and an engine
under TP sends its steps without pickling (the host group carries only one "wake" per burst of steps)."""

import random

import numpy as np
import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.attention.base import SeqChunk
from mlaserve.distributed import tp
from mlaserve.engine.step_broadcast import (
    EAGER,
    FIRST_WORDS,
    HEADER,
    PARK,
    STEP,
    SUFFIX,
    EagerStep,
    StepChannel,
    SuffixStep,
    decode_words,
    encode,
)


def _chunks(rng, n, max_tokens, max_pages):
    return [
        SeqChunk(
            [rng.randrange(200_000) for _ in range(rng.randrange(1, max_tokens))],
            rng.randrange(10_000),
            [rng.randrange(1 << 20) for _ in range(rng.randrange(0, max_pages))],
            rng.choice(["none", "last", "all"]),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("n_dec, n_pre, max_tokens, max_pages", [(0, 0, 2, 2), (8, 0, 3, 130), (2, 3, 9000, 200)])
def test_codec_round_trips(n_dec, n_pre, max_tokens, max_pages):
    rng = random.Random(n_dec * 100 + n_pre)
    decode, prefill = _chunks(rng, n_dec, max_tokens, max_pages), _chunks(rng, n_pre, max_tokens, max_pages)
    words = encode(decode, prefill)
    assert words.dtype == np.int32 and list(words[:HEADER]) == [STEP, len(words), n_dec, n_pre]
    assert decode_words(words) == (decode, prefill)


def test_codec_refuses_values_outside_int32():
    with pytest.raises(ValueError, match="outside int32"):
        encode([SeqChunk([1], 0, [2**31])], [])


GROUP = object()  # the channel's process group, as the broadcasts must name it


def test_channel_over_one_rank_group_round_trips(monkeypatch):
    """send and recv through the same buffer (the broadcast a no-op, each from rank 0 over the channel's group):
    short steps, one of exactly FIRST_WORDS words (one broadcast), long ones (a second broadcast) and the park
    message, and EAGER and SUFFIX steps as their own types; an unknown kind is an error naming it."""
    sent = []

    def broadcast(t, src, group):
        assert src == 0 and group is GROUP
        sent.append(t.numel())

    monkeypatch.setattr("mlaserve.engine.step_broadcast.dist.broadcast", broadcast)
    ch = StepChannel(torch.device("cpu"), GROUP)
    rng = random.Random(0)
    exact = FIRST_WORDS - len(encode([], [SeqChunk([], 0, [1, 2])]))  # tokens that make it FIRST_WORDS words
    steps = [(_chunks(rng, 2, 4, 5), [SeqChunk(list(range(n_tok)), 0, [1, 2])]) for n_tok in (3, 2 * FIRST_WORDS)]
    steps.insert(1, ([], [SeqChunk(list(range(exact)), 0, [1, 2])]))
    for step in steps:
        ch.send(*step)
        assert ch.recv() == step
    assert len(encode(*steps[1])) == FIRST_WORDS
    ch.park()
    assert ch.recv() is None
    n_long = len(encode(*steps[2]))
    assert sent == [FIRST_WORDS] * 4 + [FIRST_WORDS, n_long - FIRST_WORDS] * 2 + [FIRST_WORDS] * 2
    assert int(ch.buf[0]) == PARK
    for kind, cls in ((EAGER, EagerStep), (SUFFIX, SuffixStep)):  # steps with a form of their own
        ch.send(*steps[0], kind)
        assert ch.recv() == cls(*steps[0])
    ch.buf[0] = 9
    with pytest.raises(RuntimeError, match="step message: unknown kind 9 from rank 0"):
        ch.recv()


def test_tp2_steps_go_without_broadcast_object(tiny_ckpt, monkeypatch):
    """Through LLM at attn-tp2 x moe-tp2 (two gloo processes): the greedy tokens equal TP1's, and rank 0 calls
    tp.broadcast_object (a pickle over the host group) once per generate call (the wake), not once per step."""
    prompts = [[7, 8, 9], list(range(20, 61)), [300] * 12]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_ckpt, device="cpu").generate(prompts, sp, use_tqdm=False)]
    calls = []
    real = tp.broadcast_object
    monkeypatch.setattr(tp, "broadcast_object", lambda obj=None, src=0: calls.append(obj) or real(obj, src))
    llm = LLM(tiny_ckpt, device="cpu", tp=2, on_rank_failure=lambda e: None)
    try:
        for _ in range(2):
            calls.clear()
            steps = llm.engine.num_steps
            assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
            assert llm.engine.num_steps - steps >= 10
            assert calls == [("wake",)]
            assert not llm.engine.runner._awake  # parked after the call
    finally:
        llm.close()


class _Wire:
    """dist.broadcast between a sender and a receiver in one process: what rank 0 sends, the follower receives."""

    def __init__(self):
        self.queue, self.sending = [], True

    def __call__(self, t, src, group):
        assert src == 0 and group is GROUP
        if self.sending:
            self.queue.append(t.clone())
        else:
            t.copy_(self.queue.pop(0))


class _Draft:
    """What a follower's draft is called with (worker.follow_draft)."""

    def __init__(self, k, width):
        self.k, self.calls = k, []
        self.draft = type("D", (), {"hidden_width": width, "hidden_dtype": torch.float32})()

    def extend(self, seq, hidden):
        self.calls.append(("extend", seq, hidden))

    def run_verified(self, *args):
        self.calls.append(("run_verified", *args))


@pytest.mark.parametrize("shifted", [False, True])
def test_draft_steps_reach_a_follower_unchanged(monkeypatch, shifted):
    """A sharded draft's steps (ModelRunner.follow_draft, follow_draft_verified), as a follower unpacks them
    (worker.follow_draft): the same chunks, tokens, accepted counts, shifts and hidden states."""
    from types import SimpleNamespace

    from mlaserve.distributed.worker import follow_draft
    from mlaserve.engine.runner import ModelRunner
    from mlaserve.engine.step_broadcast import DraftMessage

    wire = _Wire()
    monkeypatch.setattr("mlaserve.engine.step_broadcast.dist.broadcast", wire)
    ch = StepChannel(torch.device("cpu"), GROUP)
    rank0 = SimpleNamespace(_wake=lambda: None, steps=ch)
    n, K, W = 3, 2, 5
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 1000, (n, K + 1), generator=g)
    acc = torch.randint(0, K + 1, (n,), generator=g, dtype=torch.int32)  # a kernel's int32 counts travel as int64
    shift = torch.randint(0, 3, (n,), generator=g) if shifted else None
    hidden = torch.randn(n * (K + 1), W, generator=g)
    starts, pages = [5, 17, 0], [[1, 2], [3], [4, 5, 6]]
    ModelRunner.follow_draft_verified(rank0, starts, pages, y, acc, shift, hidden)
    seq = [SeqChunk([7, 8, 9], 4, [1, 2], "last"), SeqChunk([10], 0, [3], "none")]
    ModelRunner.follow_draft(rank0, seq, hidden[:4])

    wire.sending = False
    draft = _Draft(K, W)
    for _ in range(2):
        msg = ch.recv()
        assert isinstance(msg, DraftMessage)
        follow_draft(draft, ch, msg)
    assert not wire.queue  # every tensor sent was read
    (_, y2, acc2, h2, starts2, pages2, shift2), (_, seq2, h3) = draft.calls
    assert y2.dtype == acc2.dtype == torch.int64 and h2.dtype == h3.dtype == torch.float32
    assert torch.equal(y2, y) and torch.equal(acc2, acc.long()) and torch.equal(h2, hidden)
    assert (starts2, pages2) == (starts, pages)
    assert shift2 is None if shift is None else shift2.dtype == torch.int64 and torch.equal(shift2, shift)
    assert seq2 == seq and torch.equal(h3, hidden[:4])
