"""The model's layer flow against the one before the MoE-norm fusion, bit for bit: logits and EAGLE3 aux streams.

Before, a decoder layer returned (MLP/MoE output, stream) and the next layer's input norm added them; now each layer
ends with the norm after it, and on one rank the Triton MoE fuses its sum over top-k into that add + norm. Shared
by tests/model (torch MoE), tests/kernels_interp (Triton MoE, interpreted) and tests/gpu (compiled)."""

from __future__ import annotations

import torch

from tests.helpers.model_backend_check import PAGE, _batches


def forward_before(model, input_ids: torch.Tensor, positions: torch.Tensor, batch):
    """DeepseekV3ForCausalLM.forward before the fusion (its layer loop inlined): the reference flow."""
    m = model.model
    h = m.embed_tokens(input_ids)
    cos, sin = m.rotary(positions)
    aux, residual = {}, None
    for i, layer in enumerate(m.layers):
        if i in model.aux_layer_ids:
            if residual is not None:  # the stream entering layer i, materialised
                h, residual = h + residual, None
            aux[i] = h
        if residual is None:
            x, residual = layer.input_layernorm(h), h
        else:
            x, residual = layer.input_layernorm(h, residual)
        x, residual = layer.post_attention_layernorm(layer.self_attn(x, cos, sin, batch), residual)
        h = layer.mlp(x)  # the block's output alone: its sum over k, (all-reduce,) no norm
    if len(m.layers) in model.aux_layer_ids:
        h, residual = h + residual, None
        aux[len(m.layers)] = h
    h = m.norm(h) if residual is None else m.norm(h, residual)[0]
    return (h, torch.cat([aux[i] for i in model.aux_layer_ids], dim=-1)) if model.aux_layer_ids else h


def load_model(ckpt: str, device, dtype, moe_impl: str, kernels=None):
    """kernels: a KernelConfig for the model (default: the defaults)."""
    from mlaserve.config import ModelConfig
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
    from mlaserve.models.weights import load_weights

    cfg = ModelConfig.from_pretrained(ckpt)
    model = DeepseekV3ForCausalLM(cfg, dtype=dtype, moe_impl=moe_impl, kernels=kernels or KernelConfig())
    load_weights(model, ckpt, progress=False)
    return model.to(device).eval()


def run_steps(model, device, backend: str = "torch", forward=None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """model_backend_check's two steps on a fresh cache -> per step (logits rows' hidden, aux or None)."""
    from mlaserve.attention.torch_ref import TorchRefBackend

    cfg = model.config
    dtype = model.lm_head.weight.dtype
    cache = torch.zeros(cfg.num_hidden_layers, 8, PAGE, cfg.kv_cache_dim, dtype=dtype, device=device)
    if backend == "triton":  # imported only here: CI's CPU machines have no triton
        from mlaserve.attention.triton_mla import TritonMLABackend

        attn = TritonMLABackend(cache, cfg.kv_lora_rank)
    else:
        attn = TorchRefBackend(cache, cfg.kv_lora_rank)
    out = []
    with torch.no_grad():
        for batch in _batches(attn, device, cfg.vocab_size, torch.Generator().manual_seed(0)):
            r = (
                forward(model, batch.input_ids, batch.positions, batch)
                if forward
                else model(batch.input_ids, batch.positions, batch)
            )
            h, aux = r if model.aux_layer_ids else (r, None)
            out.append((model.compute_logits(h[batch.logits_indices]), aux))
    return out


def check_layer_flow(model, device, backend: str = "torch", aux_layer_ids=(), before_aux: bool = True) -> int:
    """The model's forward (the fused norm where the MoE takes it) == with fuse_norm off == forward_before, logits
    and aux bit for bit; before_aux=False: forward_before without aux streams, its logits only (materialising a
    stream there is a separate add). -> how many MoE calls ran the fused norm."""
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "fuse_norm")]
    calls = []  # one entry per MoE call that got the fused norm

    def spy(module, args, kwargs):
        if kwargs.get("norm") is not None:
            calls.append(module)

    hooks = [m.experts.register_forward_pre_hook(spy, with_kwargs=True) for m in moes]
    saved = [m.fuse_norm for m in moes]
    try:
        model.aux_layer_ids = tuple(aux_layer_ids)
        fused = run_steps(model, device, backend)
        n_fused = len(calls)
        for m in moes:
            m.fuse_norm = False
        runs = {"unfused": (run_steps(model, device, backend), True)}
        model.aux_layer_ids = model.aux_layer_ids if before_aux else ()
        runs["before"] = (run_steps(model, device, backend, forward=forward_before), before_aux)
    finally:
        model.aux_layer_ids = ()
        for m, f in zip(moes, saved):
            m.fuse_norm = f
        for hk in hooks:
            hk.remove()
    assert len(calls) == n_fused, "fuse_norm=False still fused"
    for name, (other, with_aux) in runs.items():
        for step, ((lf, af), (lo, ao)) in enumerate(zip(fused, other)):
            assert not lf.isnan().any(), f"step {step}: NaN logits"
            d = (lf - lo).abs().max().item()
            assert torch.equal(lf, lo), f"step {step}: logits differ from the {name} flow (max |diff| {d:.3e})"
            if aux_layer_ids and with_aux:
                da = (af.float() - ao.float()).abs().max().item()
                assert af.shape == ao.shape and torch.equal(af, ao), (
                    f"step {step}: aux {aux_layer_ids} differ from the {name} flow (max |diff| {da:.3e})"
                )
    return n_fused
