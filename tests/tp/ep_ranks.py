"""What the EP all-to-all tests run on each rank (module-level, so spawned ranks can import it by name)."""

from __future__ import annotations

import contextlib

import torch

from mlaserve.config import ModelConfig
from mlaserve.distributed.tp import RankInfo
from mlaserve.kernel_config import KernelConfig, use_kernels
from mlaserve.models import deepseek_v3, weights

from . import ranks

A2A_OFF, A2A_ALWAYS = KernelConfig(moe_a2a_min_tokens=None), KernelConfig(moe_a2a_min_tokens=0)


@contextlib.contextmanager
def count_a2a():
    """Count the MoE layers' all-to-all calls in this process: yields the list each call appends its slice's token
    count to."""
    calls, inner = [], deepseek_v3.dispatch_combine

    def counting(experts, x, *a, **kw):
        calls.append(x.shape[0])
        return inner(experts, x, *a, **kw)

    deepseek_v3.dispatch_combine = counting
    try:
        yield calls
    finally:
        deepseek_v3.dispatch_combine = inner


def greedy(info: RankInfo, path: str, min_tokens: int | None) -> tuple:
    """ranks.greedy's schedule with moe_a2a_min_tokens = min_tokens -> (tokens, logits, all-to-all calls)."""
    model, _ = ranks.load(path, info)
    use_kernels(model, KernelConfig(moe_a2a_min_tokens=min_tokens))
    with count_a2a() as calls:
        tokens, logits = ranks.greedy(model)
    return tokens, logits, len(calls)


def moe_layer(model, bias_group: int | None):
    """The first MoE block; with bias_group, every token's experts lie in that group (rank group of EP)."""
    moe = next(m for m in model.modules() if isinstance(m, deepseek_v3.DeepseekV3MoE))
    if bias_group is not None:
        per = moe.gate.weight.shape[0] // model.config.n_group
        moe.gate.e_score_correction_bias.data[bias_group * per : (bias_group + 1) * per] += 100.0
    return moe


def moe_inputs(model, n_tokens) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)  # the same on every rank: the tokens are replicated under attention TP
    return [torch.randn(t, model.config.hidden_size, generator=g) for t in n_tokens]


def load(path: str, info: RankInfo, device: str, impl: str):
    cfg = ModelConfig.from_pretrained(path)
    with torch.device(device):
        model = deepseek_v3.DeepseekV3ForCausalLM(cfg, ranks=info, moe_impl=impl)
    weights.load_weights(model, path, progress=False)
    return model


def moe_forms(
    info: RankInfo, path: str, n_tokens: tuple, bias_group: int | None, device: str = "cpu", impl: str = "torch"
) -> list[dict]:
    """Both forms of the first MoE block on the same inputs: (all-reduce output, all-to-all output, rows this rank's
    experts received in the all-to-all) per token count, on the CPU."""
    model = load(path, info, device, impl)
    moe = moe_layer(model, bias_group)
    received = []
    moe.experts.register_forward_pre_hook(lambda m, args: received.append(args[0].shape[0]))
    out = []
    for x in moe_inputs(model, n_tokens):
        x = x.to(device)
        with torch.no_grad():
            moe.kernels = A2A_OFF
            y_ar = moe(x)
            received.clear()
            moe.kernels = A2A_ALWAYS
            y_a2a = moe(x)
        out.append(dict(all_reduce=y_ar.cpu(), a2a=y_a2a.cpu(), received=sum(received)))
    return out
