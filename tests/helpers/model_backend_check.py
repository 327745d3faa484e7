"""The model's logits through TritonMLABackend (and the Triton MoE) against TorchRefBackend, over two steps:
prompts and a first chunk, then verify-width-2 decodes mixed with a continued chunk and a fresh prompt.
Shared by the interpreter test (tiny preset on CPU) and the gpu test."""

from __future__ import annotations

import contextlib

import torch

from tests.helpers.kernel_checks import TOL, rel_err

PAGE = 16


def _batches(attn, device, vocab: int, gen: torch.Generator):
    from mlaserve.attention.base import ForwardBatch, SeqChunk

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    pages = {0: [0], 1: [1, 2], 2: [3], 3: [4, 5]}  # deliberately not in request order
    p0, p1, p3a = ids(7), ids(17), ids(4)
    step1 = ForwardBatch.build(
        [],
        [SeqChunk(p0, 0, pages[0], "all"), SeqChunk(p1, 0, pages[1], "all"), SeqChunk(p3a, 0, pages[3], "all")],
        PAGE,
        device,
        attn,
    )
    step2 = ForwardBatch.build(
        [SeqChunk(ids(2), 7, pages[0], "all"), SeqChunk(ids(2), 17, pages[1], "all")],
        [SeqChunk(ids(3), 4, pages[3], "all"), SeqChunk(ids(6), 0, pages[2], "all")],
        PAGE,
        device,
        attn,
    )
    return step1, step2


def run_model(
    ckpt: str,
    device,
    dtype,
    backend: str,
    moe_impl: str,
    seed: int = 0,
    num_splits: int | None = None,
    kernels=None,
    kv_scale: float | None = None,
) -> list[torch.Tensor]:
    """kernels: a KernelConfig for the model (default: the defaults). kv_scale: an FP8 (e4m3) latent cache with
    this scale in every layer (None: the cache in dtype)."""
    from mlaserve.attention.torch_ref import TorchRefBackend
    from mlaserve.attention.triton_mla import TritonMLABackend
    from mlaserve.config import ModelConfig
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
    from mlaserve.models.weights import load_weights

    cfg = ModelConfig.from_pretrained(ckpt)
    model = DeepseekV3ForCausalLM(cfg, dtype=dtype, moe_impl=moe_impl, kernels=kernels or KernelConfig())
    load_weights(model, ckpt, progress=False)
    model.to(device).eval()
    L = cfg.num_hidden_layers
    kv_dtype = dtype if kv_scale is None else torch.float8_e4m3fn
    cache = torch.zeros(L, 8, PAGE, cfg.kv_cache_dim, dtype=kv_dtype, device=device)
    fp8 = {} if kv_scale is None else dict(kv_scale=torch.full((L,), kv_scale, device=device), dtype=dtype)
    if backend == "triton":
        attn = TritonMLABackend(cache, cfg.kv_lora_rank, num_splits=num_splits, **fp8)
    else:
        attn = TorchRefBackend(cache, cfg.kv_lora_rank, **fp8)
    logits = []
    with torch.no_grad():
        for batch in _batches(attn, device, cfg.vocab_size, torch.Generator().manual_seed(seed)):
            h = model(batch.input_ids, batch.positions, batch)
            logits.append(model.compute_logits(h[batch.logits_indices]).float())
    return logits


def run_prefill(
    ckpt: str, device, dtype, backend: str, moe_impl: str, length: int, seed: int = 0, kernels=None
) -> torch.Tensor:
    """One prompt of `length` random tokens prefilled in one step -> fp32 logits [length, vocab] (every position:
    a long step runs the large-step forms, e.g. the FP8 kernels' W8A8). kernels: a KernelConfig (default: the
    defaults)."""
    from mlaserve.attention.base import ForwardBatch, SeqChunk
    from mlaserve.attention.torch_ref import TorchRefBackend
    from mlaserve.attention.triton_mla import TritonMLABackend
    from mlaserve.config import ModelConfig
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
    from mlaserve.models.weights import load_weights

    cfg = ModelConfig.from_pretrained(ckpt)
    model = DeepseekV3ForCausalLM(cfg, dtype=dtype, moe_impl=moe_impl, kernels=kernels or KernelConfig())
    load_weights(model, ckpt, progress=False)
    model.to(device).eval()
    pages = -(-length // PAGE)
    cache = torch.zeros(cfg.num_hidden_layers, pages, PAGE, cfg.kv_cache_dim, dtype=dtype, device=device)
    cls = TritonMLABackend if backend == "triton" else TorchRefBackend
    attn = cls(cache, cfg.kv_lora_rank)
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    batch = ForwardBatch.build([], [SeqChunk(ids, 0, list(range(pages)), "all")], PAGE, device, attn)
    with torch.no_grad():
        h = model(batch.input_ids, batch.positions, batch)
        logits = model.compute_logits(h[batch.logits_indices]).float()
    del model, cache
    return logits


def prefill_refs(
    ckpt: str, device, length: int, a8: bool = False, kv_b_a8: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the fp32 torch path's logits of a `length`-token prefill, the bf16 torch path's per-row errors to it).
    a8: both torch paths quantize the FP8 layers' activations as the checkpoint's `activation_scheme: dynamic`
    declares (a8_reference); kv_b_a8: kv_b_proj's too (KernelConfig.fp8_kv_b_a8)."""
    from mlaserve.kernel_config import KernelConfig

    kernels = KernelConfig(fp8_kv_b_a8=kv_b_a8)
    with a8_reference(a8, kv_b=kv_b_a8):
        ref = run_prefill(ckpt, device, torch.float32, "torch", "torch", length, kernels=kernels)
        return ref, _row_errs(run_prefill(ckpt, device, torch.bfloat16, "torch", "torch", length, kernels=kernels), ref)


@contextlib.contextmanager
def a8_reference(on: bool = True, kv_b: bool = False, above: int | None = None):
    """The torch path of every FP8 layer quantizes its activations per token per 128 channels before each GEMM
    (the experts: x and silu(gate) * up), as DeepSeek-V3's `activation_scheme: dynamic` and the W8A8 kernels do
    (kernels/fp8_reference.py's maths); the library's torch path is the weight-only spec. kv_b: kv_b_proj's
    prefill product too, on its FP8 copy (KernelConfig.fp8_kv_b_a8). above: only the dense linears (and kv_b_proj's
    product with kv_b), and only on more than `above` rows, as the kernels do below the experts' edge
    (KernelConfig.fp8_linear_a8_min_tokens); the experts stay weight-only. Off: unchanged."""
    if not on:
        yield
        return
    from mlaserve.kernels.fp8_reference import fp8_block_linear_ref, fp8_fused_experts_ref
    from mlaserve.layers import fp8_linear as lin
    from mlaserve.layers.quant_experts import Fp8Experts

    def quantizes(x) -> bool:
        return above is None or x.shape[0] > above

    def kv_b_a8(self, x):  # the torch path holds no FP8 copy (requantize): made here
        if not quantizes(x):
            return None
        return fp8_block_linear_ref(x, self.fp8_copy(), self.weight_scale_inv, a8=True).to(x.dtype)

    def linear(x, weight, scale_inv, impl="torch", kernels=None):
        assert impl == "torch", impl
        return fp8_block_linear_ref(x, weight, scale_inv, a8=quantizes(x)).to(x.dtype)

    def experts(self, x, topk_weights, topk_ids, impl="torch", add=None, shared=None, norm=None, plan_tokens=0):
        assert impl == "torch" and shared is None and norm is None, impl
        y = fp8_fused_experts_ref(x, *self.stored(), topk_weights, topk_ids, self.expert_offset, a8=True)
        return y.to(x.dtype) if add is None else y.to(x.dtype) + add

    saved = lin.fp8_linear, Fp8Experts.forward, lin.Fp8ExpandedLinear.forward_a8
    lin.fp8_linear = linear
    if above is None:
        Fp8Experts.forward = experts
    if kv_b:
        lin.Fp8ExpandedLinear.forward_a8 = kv_b_a8
    try:
        yield
    finally:
        lin.fp8_linear, Fp8Experts.forward, lin.Fp8ExpandedLinear.forward_a8 = saved


def check_prefill_logits(ckpt: str, device, moe_impl: str, length: int, refs=None, kernels=None) -> dict:
    """A `length`-token prefill in bf16 through the Triton path against the fp32 torch reference, held to
    check_model_backends' bf16 criterion (the typical row within max(2e-2, 1.5 x the bf16 torch path's median), at
    most max(20%, 2 x its share) of rows off by more than 5e-2) -> the errors. refs: prefill_refs' (computed if
    None)."""
    ref, base = refs if refs is not None else prefill_refs(ckpt, device, length)
    rows = _row_errs(run_prefill(ckpt, device, torch.bfloat16, "triton", moe_impl, length, kernels=kernels), ref)
    err, far = rows.median().item(), (rows > 5e-2).float().mean().item()
    base_err, base_far = base.median().item(), (base > 5e-2).float().mean().item()
    msg = (
        f"{length}-token prefill (bf16, moe={moe_impl}): per-row rel err median {err:.3e} (torch path "
        f"{base_err:.3e}), rows > 5e-2: {far:.1%} (torch path {base_far:.1%})"
    )
    assert err < max(2e-2, 1.5 * base_err) and far <= max(0.2, 2 * base_far), msg
    return dict(median=err, far=far, torch_median=base_err, torch_far=base_far, msg=msg)


def _row_errs(o: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return (o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)


def check_model_backends(ckpt: str, device, dtype, moe_impl: str, num_splits: int | None = None) -> list[float]:
    """fp32: the Triton path's logits within 1e-4 (relative) of the reference's.
    bf16: both bf16 paths (Triton, torch) are measured per logit row against the fp32 reference. A near-tie expert
    choice flipped by rounding moves a whole row by O(0.1..1) in EITHER path, at random rows, so the check is on
    the typical row (median below max(2e-2, 1.5 x the torch path's median)) and on how many rows are far off
    (> 5e-2: at most max(20%, 2 x the torch path's share)).
    In bf16 an FP8 checkpoint's dense linears quantize their activations above
    KernelConfig.fp8_linear_a8_min_tokens rows (kv_b_proj's prefill product too, on CUDA), so both torch paths do
    the same there (a8_reference); fp32 computes on x as it is (W8A16) in both."""
    from mlaserve.kernel_config import KernelConfig

    fp32, edge = dtype == torch.float32, KernelConfig.fp8_linear_a8_min_tokens
    with a8_reference(not fp32, kv_b=torch.device(device).type == "cuda", above=edge):
        ref = run_model(ckpt, device, torch.float32, "torch", "torch")
        same = None if fp32 else run_model(ckpt, device, dtype, "torch", "torch")
    out = run_model(ckpt, device, dtype, "triton", moe_impl, num_splits=num_splits)
    errs = []
    for step, (o, r) in enumerate(zip(out, ref)):
        assert o.shape == r.shape and not torch.isnan(o).any(), f"step {step}: shape {o.shape} vs {r.shape} or NaN"
        rows = _row_errs(o, r)
        if dtype == torch.float32:
            err = rel_err(o, r)
            assert err < TOL[dtype], (
                f"step {step} (fp32, moe={moe_impl}): logits relative error {err:.3e}; per-row "
                f"{[round(x, 6) for x in rows.tolist()]}"
            )
        else:
            base = _row_errs(same[step], r)
            err = rows.median().item()
            far, base_far = (rows > 5e-2).float().mean().item(), (base > 5e-2).float().mean().item()
            msg = (
                f"step {step} ({dtype}, moe={moe_impl}): per-row rel err median {err:.3e} (torch path "
                f"{base.median().item():.3e}), rows > 5e-2: {far:.0%} (torch path {base_far:.0%}); rows "
                f"{[round(x, 4) for x in rows.tolist()]}"
            )
            assert err < max(2e-2, 1.5 * base.median().item()) and far <= max(0.2, 2 * base_far), msg
        errs.append(err)
    return errs


def check_model_backends_fp8(ckpt: str, device, dtype, num_splits: int | None = None) -> list[float]:
    """An FP8 latent cache through TritonMLABackend (store, decode, prefill context) against TorchRefBackend with
    the same FP8 cache, both with the torch MoE, in dtype: held to check_model_backends' fp32 tolerance in fp32
    (both quantize the same rows), and in bf16 to the typical row within 2e-2 of the reference's logits."""
    ref = run_model(ckpt, device, dtype, "torch", "torch", kv_scale=0.37)
    out = run_model(ckpt, device, dtype, "triton", "torch", num_splits=num_splits, kv_scale=0.37)
    errs = []
    for step, (o, r) in enumerate(zip(out, ref)):
        assert o.shape == r.shape and torch.isfinite(o).all(), f"step {step}: shape {o.shape} vs {r.shape} or NaN"
        rows = _row_errs(o, r)
        err = rel_err(o, r) if dtype == torch.float32 else rows.median().item()
        assert err < (TOL[dtype] if dtype == torch.float32 else 2e-2), f"step {step} fp8 cache ({dtype}): {rows}"
        errs.append(err)
    return errs
