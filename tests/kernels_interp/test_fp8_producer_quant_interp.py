"""An FP8 model's prefill with its MLPs' W8A8 down-projection inputs quantized by their producer (the SiLU
product, by silu_mul_quant) gives the hidden states of the same model quantizing them with act_quant, bit for bit.
Under the interpreter (no sm_90) scaled_mm is replaced by its definition and the layers' CUDA checks are relaxed."""

import torch

BF = torch.bfloat16


def test_fp8_prefill_producers_quantize(kdev, tmp_path, monkeypatch):
    import torch.nn.functional as F

    import mlaserve.kernels.fp8_linear as fl
    from mlaserve.attention.base import ForwardBatch, SeqChunk
    from mlaserve.attention.triton_mla import TritonMLABackend
    from mlaserve.config import ModelConfig
    from mlaserve.kernel_config import KernelConfig
    from mlaserve.kernels.fp8_reference import dequant_fp8_block
    from mlaserve.kernels.silu_mul import silu_mul
    from mlaserve.layers.fp8_linear import Fp8Linear
    from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM
    from mlaserve.models.weights import load_weights
    from tests.helpers.quant_ckpt import FP8_ODD_TRITON, make_quantized

    sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    if kdev == "cuda" and not sm90:
        import pytest

        pytest.skip("scaled_mm's blockwise form needs sm_90")
    if kdev == "cpu":

        def scaled_mm(a, b, sa, ta, sb, tb, output_dtype):
            x = a.float() * sa.repeat_interleave(128, dim=1)[:, : a.shape[1]]
            return (x @ dequant_fp8_block(b.t(), sb.t()).t()).to(output_dtype)

        monkeypatch.setattr(F, "scaled_mm", scaled_mm)
        monkeypatch.setattr(fl, "scaled_mm_serves", lambda *a: True)
    path = make_quantized(tmp_path, "fp8-block", **dict(FP8_ODD_TRITON, v_head_dim=128, num_hidden_layers=2))
    cfg = ModelConfig.from_pretrained(path)
    kernels = KernelConfig(fp8_a8_min_tokens=4, fp8_linear_a8_min_tokens=4, fp8_scaled_mm_min_rows=8)
    model = DeepseekV3ForCausalLM(cfg, dtype=BF, moe_impl="triton", kernels=kernels)
    load_weights(model, path, progress=False)
    model.to(kdev).eval()
    counts = {"silu_q": 0}

    def run(producers: bool):
        def forward_silu_mul(self, gate, up):
            if not producers:
                return self(silu_mul(gate, up))
            counts["silu_q"] += fl.linear_form(gate, self.weight, self.weight_scale_inv, None, self.kernels)[1]
            return fl.fp8_silu_mul_linear(gate, up, self.weight, self.weight_scale_inv, kernels=self.kernels)

        monkeypatch.setattr(Fp8Linear, "forward_silu_mul", forward_silu_mul)
        L = cfg.num_hidden_layers
        cache = torch.zeros(L, 4, 16, cfg.kv_cache_dim, dtype=BF, device=kdev)
        attn = TritonMLABackend(cache, cfg.kv_lora_rank, num_splits=2)
        prefill = [SeqChunk(list(range(3, 16)), 0, [0]), SeqChunk(list(range(40, 52)), 0, [2])]  # T = 25: padded
        batch = ForwardBatch.build([], prefill, 16, kdev, attn)
        with torch.no_grad():
            return model(batch.input_ids, batch.positions, batch)

    ref = run(False)
    assert counts == {"silu_q": 0}
    got = run(True)
    assert counts["silu_q"] >= 1, counts
    ref, got = (t[0] if isinstance(t, tuple) else t for t in (ref, got))
    assert not got.isnan().any()
    assert torch.equal(got, ref)
