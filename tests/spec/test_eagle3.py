"""EAGLE3: greedy output unchanged by speculation, oracle drafts fully accepted, both draft formats load."""

import json
import os
import random

import pytest
import torch
from safetensors.torch import save_file

from mlaserve.config import EngineConfig, SpecConfig
from mlaserve.engine.engine import LLMEngine
from mlaserve.models.make_random_draft import make_random_draft
from mlaserve.spec.verify import verify_greedy
from mlaserve.types import SamplingParams

from .test_verify_rules import verify_sampled


@pytest.fixture(scope="module")
def draft(tiny_ckpt, tmp_path_factory):
    return make_random_draft(
        "tiny-eagle3", str(tmp_path_factory.mktemp("draft")), target=tiny_ckpt, seed=1, dtype="float32"
    )


def _prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(1, 90))] for _ in range(n)]


def run(engine, prompts, params):
    rids = [engine.add_request(p, params) for p in prompts]
    events = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            events[o.request_id].append(o)
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_pages
    return [events[r] for r in rids]


def tokens(evs):
    return [t for e in evs for t in e.new_token_ids]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(tiny_ckpt):
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"))
    return [tokens(e) for e in run(eng, _prompts(), GREEDY)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(
    "kw", [dict(), dict(chunked_prefill_size=16, max_num_batched_tokens=40, page_size=16)], ids=["default", "chunked"]
)
def test_greedy_equal_with_random_draft(tiny_ckpt, draft, baseline, k, kw):
    eng = LLMEngine(
        EngineConfig(model=tiny_ckpt, device="cpu", **kw),
        spec=SpecConfig(draft_model=draft, num_steps=k, num_draft_tokens=k + 1),
    )
    got = run(eng, _prompts(), GREEDY)
    assert [tokens(e) for e in got] == baseline
    for evs in got:  # exact counts: each verify event carries 1 + accepted tokens
        u = evs[-1].usage
        assert u.completion_tokens - 1 - (len(evs) - 1) == u.spec_accepted_tokens
        assert u.spec_draft_tokens == k * (len(evs) - 1)


class OracleProposer:
    """Proposes the target's own greedy continuation: every draft token must be accepted."""

    def __init__(self, prompts, outputs, k):
        self.k = k
        self.full = {tuple(p): p + o for p, o in zip(prompts, outputs)}

    def propose(self, chunks):
        out = {}
        for c in chunks:
            if c.propose:
                req = c.req
                full = self.full[tuple(req.prompt_token_ids)]
                n = req.num_tokens
                nxt = full[n : n + self.k]
                out[req.request_id] = nxt + [0] * (self.k - len(nxt))
        return out


@pytest.mark.parametrize("k", [1, 3])
def test_oracle_draft_max_accept_length(tiny_ckpt, draft, baseline, k):
    prompts = _prompts()
    spec = SpecConfig(draft_model=draft, num_steps=k, num_draft_tokens=k + 1)
    eng = LLMEngine(
        EngineConfig(model=tiny_ckpt, device="cpu"), spec=spec, proposer=OracleProposer(prompts, baseline, k)
    )
    got = run(eng, prompts, GREEDY)
    for evs, ref in zip(got, baseline):
        assert tokens(evs) == ref
        sizes = [len(e.new_token_ids) for e in evs]
        assert sizes[0] == 1  # the prefill's token
        assert all(s == k + 1 for s in sizes[1:-1]), sizes  # every verify step accepts all k drafts
        assert sizes[-1] == min(k + 1, GREEDY.max_tokens - sum(sizes[:-1]))
        want = [sum(1 for s in sizes[1:] if s - 1 > i) for i in range(k)]  # verify steps accepting draft i + 1
        assert list(evs[-1].usage.spec_accepted_per_position) == want
    totals = [sum(e[-1].usage.spec_accepted_per_position[i] for e in got) for i in range(k)]
    assert eng.stats()["spec_accepted_per_position"] == totals
    assert sum(totals) == eng.stats()["spec_accepted_tokens"]


class MissThenMatchProposer(OracleProposer):
    """The first draft token wrong, the rest the target's own: a chain rule that counted matches after the first
    mismatch would accept them."""

    def propose(self, chunks):
        out = super().propose(chunks)
        return {rid: [(d[0] + 1) % 512] + d[1:] for rid, d in out.items()}


@pytest.mark.parametrize("k", [2, 3])
def test_mismatch_then_match_accepts_nothing(tiny_ckpt, draft, baseline, k):
    prompts = _prompts()
    spec = SpecConfig(draft_model=draft, num_steps=k, num_draft_tokens=k + 1)
    prop = MissThenMatchProposer(prompts, baseline, k)
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=spec, proposer=prop)
    got = run(eng, prompts, GREEDY)
    assert [tokens(e) for e in got] == baseline
    assert all(len(e.new_token_ids) == 1 for evs in got for e in evs)
    assert eng.stats()["spec_accepted_per_position"] == [0] * k and eng.stats()["spec_accepted_tokens"] == 0


def test_aux_layer_offset(tiny_ckpt, draft):
    for offset, want in ((0, (0, 1, 2)), (1, (1, 2, 3))):
        eng = LLMEngine(
            EngineConfig(model=tiny_ckpt, device="cpu"), spec=SpecConfig(draft_model=draft, aux_layer_offset=offset)
        )
        assert eng.runner.model.aux_layer_ids == want


def test_draft_with_own_embedding_and_d2t(tiny_ckpt, draft, tmp_path):
    from mlaserve.models.eagle3 import load_draft

    d = str(tmp_path / "d")
    os.makedirs(d)
    cfg = json.load(open(os.path.join(draft, "config.json")))
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    from safetensors.torch import load_file

    t = load_file(os.path.join(draft, "model.safetensors"))
    t = {("model." + k if k.startswith("midlayer") else k): v for k, v in t.items()}  # prefixed layout too
    t["embed_tokens.weight"] = torch.randn(512, 64)
    save_file(t, os.path.join(d, "model.safetensors"))
    m = load_draft(d, torch.float32, "cpu", target_embed=None)
    assert torch.equal(m.embed_tokens.weight, t["embed_tokens.weight"])
    ids = torch.arange(256)
    assert torch.equal(ids + m.d2t, (t["d2t"] + ids))
    assert torch.equal((ids + m.d2t).sort().values, t["t2d"].nonzero().squeeze(1))


def test_mla_draft_loads_and_keeps_greedy(tiny_ckpt, baseline, tmp_path):
    """An Eagle3DeepseekV3ForCausalLM draft: the midlayer is MLA (2H-wide q/kv inputs)."""
    from mlaserve.models.eagle3 import DraftConfig, Eagle3Draft

    tcfg = json.load(open(os.path.join(tiny_ckpt, "config.json")))
    c = {
        k: tcfg[k]
        for k in (
            "hidden_size",
            "num_attention_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "rope_theta",
            "rope_scaling",
            "max_position_embeddings",
            "vocab_size",
            "rms_norm_eps",
        )
    }
    c.update(
        architectures=["Eagle3DeepseekV3ForCausalLM"],
        intermediate_size=96,
        draft_vocab_size=512,
        num_hidden_layers=1,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    )
    d = tmp_path / "mla"
    d.mkdir()
    json.dump(c, open(d / "config.json", "w"))
    model = Eagle3Draft(DraftConfig.from_pretrained(str(d)))
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(p.hf_shape, generator=g) / p.hf_shape[-1] ** 0.5 for n, p in model.named_parameters()}
    save_file(tensors, str(d / "model.safetensors"))
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=SpecConfig(draft_model=str(d), num_steps=2))
    assert [tokens(e) for e in run(eng, _prompts(), GREEDY)] == baseline


def test_sampled_spec_is_seeded_and_valid(tiny_ckpt, draft):
    params = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=16, ignore_eos=True)
    outs = []
    for _ in range(2):
        eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu"), spec=SpecConfig(draft_model=draft, num_steps=2))
        outs.append([tokens(e) for e in run(eng, _prompts(3), params)])
    assert outs[0] == outs[1] and all(len(t) == 16 for t in outs[0])


def test_verify_rules():
    logits = torch.full((2, 3, 10), -10.0)
    logits[:, 0, 4] = logits[:, 1, 7] = logits[:, 2, 1] = 10.0  # greedy path 4, 7, 1
    y, acc = verify_greedy(logits, torch.tensor([[4, 7], [4, 2]]))
    assert acc.tolist() == [2, 1] and y[0].tolist() == [4, 7, 1]
    # Sampled rule with a deterministic draft reproduces the target distribution of the first token.
    from mlaserve.layers.sampler import SamplingRow

    p = torch.tensor([0.5, 0.3, 0.2])
    lg = torch.log(p).expand(2, 3).clone()
    g = torch.Generator().manual_seed(0)
    row = SamplingRow(SamplingParams(temperature=1.0), None)
    firsts = [verify_sampled(lg, [1], row, g)[0] for _ in range(6000)]
    freq = torch.bincount(torch.tensor(firsts), minlength=3).float() / len(firsts)
    assert torch.allclose(freq, p, atol=0.03), freq
