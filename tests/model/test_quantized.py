"""Quantized checkpoints on the CPU reference path (fp32): weights stay quantized in memory, and greedy tokens and
logits equal a model running on the dequantized weights (the twin checkpoint, dequantized independently of
mlaserve), through LLM and step by step; transformers agrees where it can load the checkpoint offline."""

import random

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.layers.fp8_linear import Fp8Linear
from mlaserve.layers.moe import Experts
from mlaserve.layers.quant_experts import Fp8Experts, Int4Experts
from tests.helpers.quant_ckpt import dequantized_twin

from .helpers import RefRunner, generate_greedy, load_model
from .test_parity_hf import assert_logits_close


def _prompts(n=5, vocab=512):
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.fixture(scope="module", params=["int4", "fp8"])
def pair(request, int4_ckpt, fp8_ckpt, tmp_path_factory):
    """(scheme, quantized checkpoint, its dequantized twin)."""
    path = {"int4": int4_ckpt, "fp8": fp8_ckpt}[request.param]
    return request.param, path, dequantized_twin(path, str(tmp_path_factory.mktemp("twin") / "t"))


def test_storage_stays_quantized(pair):
    scheme, path, _ = pair
    model = load_model(path)
    experts = [m for m in model.modules() if isinstance(m, (Experts, Int4Experts, Fp8Experts))]
    assert experts and all(isinstance(m, Int4Experts if scheme == "int4" else Fp8Experts) for m in experts)
    attn = model.model.layers[0].self_attn
    if scheme == "int4":  # Kimi's ignore list: everything but the routed experts in the model dtype
        assert not any(isinstance(m, Fp8Linear) for m in model.modules())
        assert experts[0].w13_packed.dtype == torch.int32 and experts[0].w13_scale.dtype == torch.bfloat16
    else:
        assert attn.q_a_proj.weight.dtype == torch.float8_e4m3fn and attn.o_proj.weight_scale_inv.dtype == torch.float32
        assert attn.kv_b_proj.weight.dtype == torch.float32  # the one expansion: absorbed MLA projections
        # q_a (256 rows: whole blocks) and kv_a (176 rows: a partial last block) still run as one GEMM
        q_a, kv_a = attn.q_a_proj, attn.kv_a_proj_with_mqa
        assert kv_a.weight.data_ptr() == q_a.weight.data_ptr() + 256 * 192
        assert kv_a.weight_scale_inv.data_ptr() == q_a.weight_scale_inv.data_ptr() + 2 * 2 * 4
        shared = model.model.layers[1].mlp.shared_experts  # 160 rows: gate and up stay apart
        assert isinstance(shared.gate_proj, Fp8Linear) and shared.up_proj.weight.data_ptr() != (
            shared.gate_proj.weight.data_ptr() + 160 * 192
        )
    assert all(p.dtype in (torch.int32, torch.bfloat16, torch.float8_e4m3fn, torch.float32) for p in model.parameters())


def test_llm_greedy_tokens_equal_the_dequantized_twin(pair):
    scheme, path, twin = pair
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.token_ids for o in LLM(path, device="cpu").generate(_prompts(), sp, use_tqdm=False)]
    want = [o.token_ids for o in LLM(twin, device="cpu").generate(_prompts(), sp, use_tqdm=False)]
    assert got == want


def test_logits_equal_the_dequantized_twin(pair):
    """Prefill (chunked) and absorbed decode, step by step. INT4 experts compute exactly the twin's sums (same
    expert order, exact fp32 weights): equal logits. Under FP8, layers whose rows do not fill whole blocks (the
    300-wide dense MLP's gate and up) run as two GEMMs where the twin runs one: fp32 rounding apart."""
    scheme, path, twin = pair
    q, t = load_model(path), load_model(twin)
    tq, lq = generate_greedy(RefRunner(q), _prompts(3), 8, chunk=7)
    tt, lt = generate_greedy(RefRunner(t), _prompts(3), 8, chunk=7)
    assert tq == tt
    if scheme == "int4":
        assert torch.equal(lq, lt)
    else:
        assert_logits_close(lq, lt, rel=1e-5)


def test_bf16_model_dtype(pair):
    """With dtype=bfloat16 the reference dequantizes per call into bf16 (the twin's weights rounded the same way)."""
    scheme, path, twin = pair
    q, t = load_model(path, torch.bfloat16), load_model(twin, torch.bfloat16)
    (ids,) = _prompts(1)
    _, (lq,) = RefRunner(q).prefill([ids])
    _, (lt,) = RefRunner(t).prefill([ids])
    assert_logits_close(lq, lt, rel=2e-2)


def test_transformers_reads_the_int4_checkpoint(pair):
    """transformers decompresses compressed-tensors INT4 offline (into bf16: its weights round q * scale, ours are
    the exact fp32 products), and reads the twin exactly. It cannot load the FP8 form here (it wants accelerate)."""
    scheme, path, twin = pair
    if scheme != "int4":
        pytest.skip("transformers' FP8 loader needs accelerate, which the test extra does not install")
    pytest.importorskip("compressed_tensors")
    from .hf_ref import hf_logits, hf_model

    ours = load_model(path)
    hf_q, hf_t = hf_model(path), hf_model(twin)
    for ids in _prompts(3):
        _, (logits,) = RefRunner(ours).prefill([ids])
        assert_logits_close(logits, hf_logits(hf_t, ids), rel=1e-5)
        assert_logits_close(logits, hf_logits(hf_q, ids), rel=1e-2)


@pytest.mark.parametrize("cls,extra", [(Int4Experts, {"num_experts": 8}), (Fp8Experts, {})])
def test_the_kernel_call_of_an_ep_rank(cls, extra, monkeypatch):
    # impl="triton" hands the kernel the rank's experts and their first id, and (INT4) the expert count over all
    # ranks, by which the GEMV's tiles follow the pairs the rank is expected to own
    import importlib

    module, fn = cls.kernel
    seen = {}
    monkeypatch.setattr(
        importlib.import_module(f"mlaserve.kernels.{module}"), fn, lambda *a, **k: seen.update(args=a, **k) or a[0]
    )
    experts = cls(8, 128, 128, ep_rank=1, ep_size=2)
    x = torch.zeros(1, 128)
    experts.forward(x, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.int64), impl="triton")
    assert seen["args"][1:-3] == experts.stored() and seen["args"][-1] == 4 and seen["all_local"] is False
    assert {k: seen[k] for k in extra} == extra and ("num_experts" in seen) == bool(extra)
