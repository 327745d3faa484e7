"""transformers' DeepseekV3ForCausalLM (or DeepseekV2ForCausalLM, as config.json names it) as the reference:
full-prompt logits and greedy generation."""

from __future__ import annotations

import json
import os

import pytest
import torch


def hf_model(path: str, dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    with open(os.path.join(path, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    cls = transformers.DeepseekV2ForCausalLM if arch == "DeepseekV2ForCausalLM" else transformers.DeepseekV3ForCausalLM
    return cls.from_pretrained(str(path), dtype=dtype).eval()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, [len, vocab] fp32."""
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """generate() greedily with its DynamicCache (EOS off): (the `steps` new tokens, their logits [steps, vocab])."""
    x = torch.tensor([ids])
    # An explicit mask: without one generate() masks every token equal to pad_token_id. Plain greedy: the
    # folder's generation_config.json (temperature, top_p, repetition_penalty) must not apply.
    out = hf.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=steps,
        do_sample=False,
        repetition_penalty=1.0,
        temperature=None,
        top_p=None,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert len(out.logits) == steps
    return out.sequences[0, len(ids) :].tolist(), torch.cat(out.logits).float()
