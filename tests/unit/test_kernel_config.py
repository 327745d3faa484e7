"""KernelConfig: the MLASERVE_* kernel switches read once (from_env, the only place), carried by EngineConfig (the
same on every rank), logged once at start, and handed to every module of the model that launches kernels."""

import ast
import logging
from pathlib import Path

import pytest

from mlaserve.config import EngineConfig
from mlaserve.kernel_config import KernelConfig

PKG = Path(__file__).resolve().parents[2] / "mlaserve"


def test_from_env_defaults_and_switches():
    assert KernelConfig.from_env({}) == KernelConfig()
    off = KernelConfig.from_env(
        {
            "MLASERVE_PDL": "0",
            "MLASERVE_ABSORB_STORE": "0",
            "MLASERVE_MOE_TMA": "0",
            "MLASERVE_MOE_GEMV": "0",
            "MLASERVE_MOE_PREWAIT": "0",
            "MLASERVE_ALLREDUCE": "nccl",
        }
    )
    assert not (off.pdl or off.absorb_store or off.moe_tma or off.moe_gemv or off.moe_prewait)
    assert off.moe_gemv_config() is False
    assert off.allreduce == "nccl" and KernelConfig.from_env({}).allreduce == "auto"
    tiles = KernelConfig.from_env({"MLASERVE_MOE_GEMV": "2:4:8:1"})
    assert tiles.moe_gemv and tiles.moe_gemv_tiles == (2, 4, 8, 1)
    with pytest.raises(ValueError, match="MLASERVE_MOE_GEMV"):
        KernelConfig.from_env({"MLASERVE_MOE_GEMV": "2:4"})


def test_pdl_on_by_default_and_off_everywhere_with_0():
    """One switch for one GPU and TP ranks alike (kernels/pdl.py): on unless MLASERVE_PDL=0 (any other value, "all"
    included, is on)."""
    assert KernelConfig.from_env({}).pdl
    assert KernelConfig.from_env({"MLASERVE_PDL": "all"}).pdl
    assert not KernelConfig.from_env({"MLASERVE_PDL": "0"}).pdl


def test_bad_threshold_names_the_field():
    with pytest.raises(ValueError, match="kernels.fuse_shared_max_tokens"):
        KernelConfig(fuse_shared_max_tokens=-1)
    with pytest.raises(ValueError, match="MLASERVE_ALLREDUCE"):
        KernelConfig.from_env({"MLASERVE_ALLREDUCE": "multimem"})


def test_engine_config_reads_the_environment_once(monkeypatch):
    monkeypatch.setenv("MLASERVE_ABSORB_STORE", "0")
    cfg = EngineConfig(model="m")
    monkeypatch.setenv("MLASERVE_ABSORB_STORE", "1")  # read when the config was made, not at the point of use
    assert cfg.kernels.absorb_store is False


def test_engine_hands_its_kernel_config_down_and_logs_it(tiny_ckpt, caplog):
    from mlaserve.engine.engine import LLMEngine

    kc = KernelConfig(pdl=False, fuse_shared_max_tokens=5, gemv_serve_tokens=1)
    with caplog.at_level(logging.INFO, logger="mlaserve.engine"):
        eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu", kernels=kc))
    assert eng.runner.kernels == kc
    with_kernels = [m for m in eng.runner.model.modules() if hasattr(m, "kernels")]
    assert len(with_kernels) > 10 and all(m.kernels is eng.runner.kernels for m in with_kernels)
    assert [r.message for r in caplog.records].count(f"kernels: {kc}") == 1


@pytest.mark.parametrize("ckpt", ["int4_ckpt", "fp8_ckpt"])
def test_quantized_modules_get_the_kernel_config(ckpt, request):
    """Fp8Linear and the quantized experts take the config the way Linear and Experts do (use_kernels)."""
    from mlaserve.config import ModelConfig
    from mlaserve.layers.fp8_linear import Fp8Linear
    from mlaserve.layers.quant_experts import QuantExperts
    from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM

    path = request.getfixturevalue(ckpt)
    kc = KernelConfig(pdl=False, no_align_max_pairs=3)
    model = DeepseekV3ForCausalLM(ModelConfig.from_pretrained(path), kernels=kc)
    quant = [m for m in model.modules() if isinstance(m, (Fp8Linear, QuantExperts))]
    assert quant and all(m.kernels is kc for m in quant)
    if ckpt == "fp8_ckpt":
        assert any(isinstance(m, Fp8Linear) for m in quant)


def test_no_module_reads_the_environment_at_its_point_of_use():
    """os.environ / os.getenv appear only in kernel_config.py (the kernel switches) and paths.py (the cache)."""
    allowed = {"kernel_config.py", "paths.py"}
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert not found, found
