"""The shipped default model (`mlaserve/assets/pycode-13m`, trained by `mlaserve train-model`) and its EAGLE3 draft
(`pycode-13m-eagle3`, distilled by `mlaserve train-draft`): what the package promises a new user.

- the model loads in transformers and in mlaserve with equal logits (fp32), on real code prompts;
- its card's held-out bits per byte are at most 1.1;
- EAGLE3 with the shipped draft gives exactly plain decoding's greedy tokens;
- the draft accepts at least 55 % of its tokens at K=1 on held-out prompts (the ones train-draft measured on).
"""

import json
import os

import pytest

from mlaserve.llm import LLM, default_draft_path, default_model_path
from mlaserve.types import SamplingParams

from .helpers import RefRunner, generate_greedy, load_model
from .hf_ref import hf_greedy, hf_logits, hf_model
from .test_parity_hf import assert_logits_close

CODE = [
    "def read_json(path):",
    "import os\n\n\nclass Config:\n    def __init__(self, name",
    'def is_prime(n):\n    """Return True if n is prime."""\n    if n < 2:\n        return False\n    for i in range(',
]


def _draft_ready() -> bool:
    return os.path.isfile(os.path.join(default_draft_path(), "model.safetensors"))


@pytest.fixture(scope="module")
def tokenizer():
    from mlaserve.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_model_path())


def test_card_and_size():
    """Model plus draft at most 40 MB; the card's held-out bits per byte at most 1.1 over a complete run."""
    d = default_model_path()
    facts = json.load(open(os.path.join(d, "train_model.json")))
    assert facts["complete"] and facts["bpb"] <= 1.1, facts["bpb"]
    assert "DeepseekV3ForCausalLM" in json.load(open(os.path.join(d, "config.json")))["architectures"]
    folders = [f for f in (d, default_draft_path()) if os.path.isdir(f)]
    size = sum(os.path.getsize(os.path.join(f, n)) for f in folders for n in os.listdir(f))
    assert size <= 40e6, size


def test_logits_equal_transformers(tokenizer):
    pytest.importorskip("transformers")
    path = default_model_path()
    model, hf = load_model(path), hf_model(path)
    batch = [tokenizer.encode(p, add_special_tokens=True) for p in CODE]
    _, logits = RefRunner(model).prefill(batch)
    for ids, lg in zip(batch, logits):
        assert_logits_close(lg, hf_logits(hf, ids))
    tokens, logits = generate_greedy(RefRunner(model), batch, steps=12)
    for b, ids in enumerate(batch):
        ref_tokens, ref_logits = hf_greedy(hf, ids, 12)
        assert tokens[b] == ref_tokens
        assert_logits_close(logits[:, b], ref_logits)


def _held_out_prompts(n: int) -> list[list[int]]:
    with open(os.path.join(default_draft_path(), "eval_prompts.jsonl")) as f:
        return [json.loads(line)["prompt_token_ids"] for line in f][:n]


@pytest.mark.skipif(not _draft_ready(), reason="the default draft is not in this tree")
def test_eagle3_with_the_shipped_draft_keeps_greedy_and_accepts():
    """K=1 greedy on held-out prompts: the same tokens as plain decoding, and at least 55 % of drafts accepted
    (the count the engine keeps per draft position)."""
    prompts = _held_out_prompts(12)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(device="cpu", dtype="float32")
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.close()
    # vLLM's keys: the default model's own draft is taken when no "model" is given
    spec = LLM(device="cpu", dtype="float32", speculative_config={"method": "eagle3", "num_speculative_tokens": 1})
    assert spec.engine_config.model == default_model_path()
    got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    st = spec.engine.stats()
    spec.close()
    assert got == want
    rate = st["spec_accepted_per_position"][0] / st["spec_steps"]
    print(f"\nshipped draft, K=1: {st['spec_accepted_per_position'][0]} of {st['spec_steps']} accepted ({rate:.3f})")
    assert rate >= 0.55


def test_default_sampling_is_the_generation_config():
    """`mlaserve generate` with no sampling flags samples as the model's generation_config.json says."""
    from mlaserve.args import sampling_params_from_args
    from mlaserve.cli import build_parser

    argv = ["generate", "--prompt", "x"]
    args = build_parser(argv).parse_args(argv)
    p = sampling_params_from_args(args, default_model_path())
    gen = json.load(open(os.path.join(default_model_path(), "generation_config.json")))
    keys = ("temperature", "top_p", "repetition_penalty")
    assert tuple(getattr(p, k) for k in keys) == tuple(gen[k] for k in keys)
    argv += ["--temperature", "0"]
    assert sampling_params_from_args(build_parser(argv).parse_args(argv), default_model_path()).temperature == 0
    assert sampling_params_from_args(build_parser(argv).parse_args(argv), None).top_p == 1.0


def test_first_command_prints_code(capsys):
    """README's first command: the default model continues a Python header with an indented body."""
    from mlaserve.cli import main

    assert main(["generate", "--prompt", "def read_json(path):", "--max-tokens", "32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    body = out.split("def read_json(path):", 1)[1]
    assert body.startswith("\n    "), out


@pytest.mark.skipif(not _draft_ready(), reason="the default draft is not in this tree")
def test_a_spec_config_given_whole_is_kept_on_the_default_model():
    """LLM(speculative_config=SpecConfig(...)) with no model: the config as given (no default draft substituted)."""
    from mlaserve.config import SpecConfig

    spec = SpecConfig.from_dict(dict(draft_model=default_draft_path(), num_steps=2))
    llm = LLM(device="cpu", dtype="float32", speculative_config=spec)
    try:
        assert llm.engine.spec is spec and llm.engine.spec_k == 2
    finally:
        llm.close()
