"""MTP speculative decoding (DeepSeek-V3's multi-token prediction layer as the draft): the layer against one built
from transformers' decoder layer, greedy outputs unchanged, every step's draft the reference's, the published
layout, and bad input."""

import json
import os
import random

import pytest
import torch
from safetensors import safe_open

from mlaserve.attention.base import ForwardBatch, SeqChunk
from mlaserve.config import EngineConfig, ModelConfig, SpecConfig
from mlaserve.engine.engine import LLMEngine
from mlaserve.models.make_random import make_random
from mlaserve.models.weights import CheckpointError, checkpoint_files
from mlaserve.types import SamplingParams

from ..model.hf_ref import hf_model
from .test_eagle3 import run, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """The tiny preset with one MTP layer (model.layers.3), fp32; rms_norm_eps 1e-2, so a norm built without the
    config's epsilon (1e-6 by default) shows in the transformers comparison."""
    return make_random(
        "tiny",
        str(tmp_path_factory.mktemp("mtp")),
        seed=0,
        dtype="float32",
        progress=False,
        mtp=True,
        overrides={"rms_norm_eps": 1e-2},
    )


def _prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(2, 90))] for _ in range(n)]


def _tensors(path: str, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in checkpoint_files(path):
        with safe_open(f, framework="pt", device="cpu") as h:
            out |= {k[len(prefix) :]: h.get_tensor(k) for k in h.keys() if k.startswith(prefix)}
    return out


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class HfMtp:
    """The reference: transformers' DeepseekV3 target for the final normed hidden, transformers' decoder layer for
    layer L (loaded by transformers from the same checkpoint as a model one layer deeper), and the MTP's own
    tensors (enorm, hnorm, eh_proj, shared_head.norm) applied here in plain torch."""

    def __init__(self, path: str):
        import transformers

        self.target = hf_model(path)
        c = self.target.config
        self.L, self.eps = c.num_hidden_layers, c.rms_norm_eps
        deeper = transformers.DeepseekV3ForCausalLM.from_pretrained(
            path, dtype=torch.float32, num_hidden_layers=self.L + 1, attn_implementation="eager"
        ).eval()
        self.layer, self.rotary = deeper.model.layers[self.L], deeper.model.rotary_emb
        for m in [*self.target.modules(), *self.layer.modules()]:  # transformers builds q_a_layernorm and
            if hasattr(m, "variance_epsilon"):  # kv_a_layernorm with 1e-6 whatever the config says; vLLM, SGLang
                m.variance_epsilon = self.eps  # and mlaserve with rms_norm_eps
        self.w = _tensors(path, f"model.layers.{self.L}.")

    @torch.no_grad()
    def hidden(self, seq: list[int]) -> torch.Tensor:
        """The target's final normed hidden at every position [len, D]."""
        return self.target.model(torch.tensor([seq])).last_hidden_state[0]

    @torch.no_grad()
    def logits(self, seq: list[int], h: torch.Tensor | None = None) -> torch.Tensor:
        """[len - 1, V]: row p, from (the target's hidden at p, seq[p + 1]), predicts seq[p + 2]."""
        h = self.hidden(seq) if h is None else h
        w, T = self.w, len(seq) - 1
        e = self.target.model.embed_tokens.weight[torch.tensor(seq[1:])]
        x = torch.cat([_rms(e, w["enorm.weight"], self.eps), _rms(h[:T], w["hnorm.weight"], self.eps)], -1)
        x = x @ w["eh_proj.weight"].T
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = self.layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x[None], pos))
        y = (y[0] if isinstance(y, tuple) else y)[0]
        return _rms(y, w["shared_head.norm.weight"], self.eps) @ self.target.lm_head.weight.T


@pytest.fixture(scope="module")
def ref(mtp_ckpt):
    pytest.importorskip("transformers")
    return HfMtp(mtp_ckpt)


def _engine(path, k=1, **kw):
    spec = SpecConfig.from_dict({"algorithm": "MTP", "num_steps": k})
    return LLMEngine(EngineConfig(model=path, device="cpu", **kw), spec=spec)


def test_layer_matches_transformers(mtp_ckpt, ref):
    """The draft's logits over whole sequences, from the reference's target hidden: transformers' within fp32
    rounding; and the draft's target hidden (the runner's aux) is transformers' final normed hidden."""
    eng = _engine(mtp_ckpt)
    p = eng.proposer
    for seq in _prompts(4, seed=3):
        h = ref.hidden(seq)
        T = len(seq) - 1
        pages = list(range(-(-T // eng.cfg.page_size)))
        batch = ForwardBatch.build([], [SeqChunk(seq[1:], 0, pages, "all")], eng.cfg.page_size, p.device, p.attn)
        with torch.inference_mode():
            normed, _ = p.draft(batch.input_ids, batch.positions, h[:T].clone(), batch)
            got = p.draft.lm_head(normed)
            out = eng.runner.model(torch.tensor(seq), torch.arange(len(seq)), _prefill(eng, seq))
        want = ref.logits(seq, h)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(out[1], h, atol=2e-5, rtol=2e-5)  # aux id -1: the final normed hidden


def test_layer_takes_the_engine_dtype(mtp_ckpt):
    """A bf16 engine over the fp32 checkpoint: the MTP layer's parameters take the dtypes the target's MoE layer's
    take (bf16, the router fp32), and its own norms and eh_proj bf16."""
    eng = _engine(mtp_ckpt, dtype="bfloat16")
    mine = dict(eng.proposer.draft.layer.named_parameters())
    theirs = dict(eng.runner.model.model.layers[2].named_parameters())
    assert {n: p.dtype for n, p in mine.items() if n in theirs} == {n: p.dtype for n, p in theirs.items()}
    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert mine[n].dtype == torch.bfloat16, n
    assert eng.proposer.draft.hidden_dtype == torch.bfloat16


def _prefill(eng, seq):
    n = len(seq)
    pages = list(range(-(-n // eng.cfg.page_size)))
    return ForwardBatch.build(
        [], [SeqChunk(seq, 0, pages, "all")], eng.cfg.page_size, eng.runner.device, eng.runner.attn
    )


@pytest.fixture(scope="module")
def baseline(mtp_ckpt):
    return [tokens(e) for e in run(LLMEngine(EngineConfig(model=mtp_ckpt, device="cpu")), _prompts(), GREEDY)]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(disable_overlap_schedule=True, chunked_prefill_size=16, max_num_batched_tokens=40, page_size=16)],
    ids=["overlapped", "serial-chunked"],
)
def test_greedy_equal(mtp_ckpt, baseline, k, kw):
    got = run(_engine(mtp_ckpt, k, **kw), _prompts(), GREEDY)
    assert [tokens(e) for e in got] == baseline
    for evs in got:
        u = evs[-1].usage
        assert u.completion_tokens - 1 - (len(evs) - 1) == u.spec_accepted_tokens
        assert u.spec_draft_tokens == k * (len(evs) - 1)


def test_every_draft_is_the_reference(mtp_ckpt, ref, baseline):
    """Each verify's draft (K=1) is the reference's arg-max from (the target's hidden at n - 2, token n - 1), n the
    sequence's length then, over the final sequence; rows whose top two reference logits lie within 1e-3 are left
    out (fp32 rounding may order them either way)."""
    eng = _engine(mtp_ckpt, 1, disable_overlap_schedule=True)
    seen = []
    verify = eng.loop._verify

    def spy(logits, drafts, reqs, prev=None):
        seen.extend((r.request_id, len(r.all_token_ids), int(d)) for r, d in zip(reqs, drafts[:, 0].tolist()))
        return verify(logits, drafts, reqs, prev)

    eng.loop._verify = spy
    prompts = _prompts()
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    outs = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    assert [outs[r] for r in rids] == baseline
    checked = 0
    for rid, p in zip(rids, prompts):
        seq = p + outs[rid]
        logits = ref.logits(seq)
        top = logits.topk(2, dim=-1)
        for r, n, d in seen:
            if r != rid:
                continue
            row = n - 2
            if top.values[row, 0] - top.values[row, 1] < 1e-3:
                continue
            assert d == int(top.indices[row, 0]), (rid, n)
            checked += 1
    assert checked >= 150  # 8 requests x 23 verifies, nearly all clear of ties


def test_dummy_weights(mtp_ckpt):
    """--load-format dummy: the MTP layer is made in place too (random, finite, its own draw), and greedy output is
    the plain dummy engine's."""
    prompts = _prompts(4)
    plain = LLMEngine(EngineConfig(model=mtp_ckpt, device="cpu", load_format="dummy"))
    base = [tokens(e) for e in run(plain, prompts, GREEDY)]
    eng = _engine(mtp_ckpt, 2, load_format="dummy")
    assert [tokens(e) for e in run(eng, prompts, GREEDY)] == base
    w = eng.proposer.draft.layer.eh_proj.weight
    assert torch.isfinite(w).all() and w.std() > 0
    assert eng.proposer.draft.lm_head is eng.runner.model.lm_head  # the target's, shared


def test_plain_engine_reserving_for_a_draft_it_will_share(mtp_ckpt, baseline):
    # reserve_for: the plain engine's runner sets aside the draft's pages and weights as the speculative engine's
    # own runner does, and a speculative engine built on it gives plain greedy output
    spec = SpecConfig(algorithm="MTP", num_steps=1, num_draft_tokens=2)
    cfg = EngineConfig(model=mtp_ckpt, device="cpu")
    own = LLMEngine(cfg, spec=spec).runner
    plain = LLMEngine(cfg, reserve_for=spec)
    assert own.reserve_bytes > 0 and own.extra_page_bytes > 0
    assert (plain.runner.reserve_bytes, plain.runner.extra_page_bytes) == (own.reserve_bytes, own.extra_page_bytes)
    assert plain.proposer is None and plain.spec is None
    assert LLMEngine(EngineConfig(model=mtp_ckpt, device="cpu")).runner.reserve_bytes == 0
    shared = LLMEngine(cfg, runner=plain.runner, spec=spec)
    assert [tokens(e) for e in run(shared, _prompts(), GREEDY)] == baseline


def test_published_layout(tmp_path):
    """FP8 (deepseek-v3's form): layer L's linears FP8 with block scales like every layer's, eh_proj and the copies
    of embed_tokens and lm_head in the model dtype, the copies equal to the target's; the loader reads layer L
    only for the draft and skips it for the target."""
    from tests.helpers.quant_ckpt import FP8_ODD

    path = make_random(
        "tiny",
        str(tmp_path),
        seed=0,
        dtype="bfloat16",
        progress=False,
        quantization="fp8-block",
        overrides=FP8_ODD,
        mtp=True,
    )
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["num_nextn_predict_layers"] == 1
    t = _tensors(path, "")
    L = "model.layers.3."
    assert t[L + "self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert L + "self_attn.q_a_proj.weight_scale_inv" in t
    assert t[L + "mlp.experts.7.down_proj.weight"].dtype == torch.float8_e4m3fn
    for name in ("eh_proj.weight", "enorm.weight", "embed_tokens.weight", "shared_head.head.weight"):
        assert t[L + name].dtype == torch.bfloat16, name
    assert L + "eh_proj.weight_scale_inv" not in t
    assert torch.equal(t[L + "embed_tokens.weight"], t["model.embed_tokens.weight"])
    assert torch.equal(t[L + "shared_head.head.weight"], t["lm_head.weight"])
    assert tuple(t[L + "eh_proj.weight"].shape) == (FP8_ODD["hidden_size"], 2 * FP8_ODD["hidden_size"])
    # served: FP8 target and FP8 MTP layer, greedy unchanged by the draft
    prompts = _prompts(4)
    base = [tokens(e) for e in run(LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32")), prompts, GREEDY)]
    got = run(_engine(path, 2, dtype="float32"), prompts, GREEDY)
    assert [tokens(e) for e in got] == base


def test_fp8_layer_is_its_dequantized_twin(tmp_path):
    """The FP8 MTP layer computes on exactly its dequantized weights (fp32): the same drafts as the bf16-free twin
    written with every FP8 tensor dequantized, and the same logits within fp32 rounding."""
    from tests.helpers.quant_ckpt import FP8_ODD, dequantized_twin

    path = make_random(
        "tiny",
        str(tmp_path / "q"),
        seed=0,
        dtype="float32",
        progress=False,
        quantization="fp8-block",
        overrides=FP8_ODD,
        mtp=True,
    )
    twin = dequantized_twin(path, str(tmp_path / "d"))
    seq = _prompts(1, seed=5)[0]
    outs = []
    for p in (path, twin):
        eng = _engine(p)
        pr = eng.proposer
        T = len(seq) - 1
        pages = list(range(-(-T // eng.cfg.page_size)))
        batch = ForwardBatch.build([], [SeqChunk(seq[1:], 0, pages, "all")], eng.cfg.page_size, pr.device, pr.attn)
        h = torch.randn(T, FP8_ODD["hidden_size"], generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            outs.append(pr.draft(batch.input_ids, batch.positions, h, batch)[0])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_bad_input(tiny_ckpt, mtp_ckpt, tmp_path):
    with pytest.raises(ValueError, match="num_nextn_predict_layers 0"):
        _engine(tiny_ckpt)
    with pytest.raises(ValueError, match="speculative_config.draft_model: MTP"):
        SpecConfig.from_dict({"algorithm": "MTP", "draft_model": str(tmp_path)})
    assert SpecConfig.from_dict({"method": "deepseek_mtp", "num_speculative_tokens": 2}).is_mtp
    assert SpecConfig.from_dict({"algorithm": "NEXTN"}).is_mtp
    # config.json says the layer is there, the files lack it: the first missing tensor is named
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in os.listdir(tiny_ckpt):
        os.symlink(os.path.join(tiny_ckpt, f), bare / f) if f != "config.json" else None
    c = json.load(open(os.path.join(tiny_ckpt, "config.json")))
    json.dump(dict(c, num_nextn_predict_layers=1), open(bare / "config.json", "w"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.3\."):
        _engine(str(bare))
    assert ModelConfig.from_pretrained(mtp_ckpt).num_nextn_predict_layers == 1


def test_cli_flags(tmp_path):
    from mlaserve.args import engine_kwargs_from_args
    from mlaserve.cli import build_parser

    def spec(*flags):
        argv = ["generate", "--prompt", "x", *flags]
        return SpecConfig.from_dict(engine_kwargs_from_args(build_parser(argv).parse_args(argv))["speculative_config"])

    s = spec("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2")  # SGLang's name
    assert s.is_mtp and s.algorithm == "MTP" and s.num_draft_tokens == 3
    assert spec("--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}').is_mtp
    with pytest.raises(ValueError, match="speculative_config.draft_model: MTP drafts with the target checkpoint"):
        spec("--speculative-algorithm", "MTP", "--speculative-draft-model-path", str(tmp_path))
