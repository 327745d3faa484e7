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
            "MLASERVE_FP8_MOE_TMA": "0",
            "MLASERVE_MOE_GEMV": "0",
            "MLASERVE_MOE_PREWAIT": "0",
            "MLASERVE_PREFILL_GLUON": "0",
            "MLASERVE_ALLREDUCE": "nccl",
        }
    )
    assert not (off.pdl or off.absorb_store or off.moe_tma or off.fp8_moe_tma or off.moe_gemv or off.moe_prewait)
    assert not off.prefill_gluon and KernelConfig.from_env({}).prefill_gluon
    assert KernelConfig.from_env({}).absorbed_suffix
    assert not KernelConfig.from_env({"MLASERVE_ABSORBED_SUFFIX": "0"}).absorbed_suffix
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
    """os.environ / os.getenv appear only in kernel_config.py (the kernel switches), paths.py (the cache),
    server/guard.py (MLASERVE_API_KEY, read once when `serve` starts) and engine/cpu_matmul_caches.py (it sets
    oneDNN's cache capacities, which the native library reads from the environment, once, before the model)."""
    allowed = {"kernel_config.py", "paths.py", "guard.py", "cpu_matmul_caches.py"}
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert not found, found


def test_the_fp8_form_edges_are_ones_cuda_graph_padding_cannot_cross():
    """Every step and its padded graph twin take the same FP8 forms. The experts' activation edge: decode graphs
    (up to max_num_seqs x q tokens) all at or below it, a prefill of n tokens on its bucket's side. The linears'
    edges (activations, scaled_mm's rows): a decode step of n requests on the side of its graph's b; at or above
    the smallest prefill bucket, on a bucket (below it, prefill graphs take only the steps above it: the next
    test)."""
    from mlaserve.engine.cuda_graph import PREFILL_TOKEN_BUCKETS, decode_graph_sizes, graph_safe_kernels

    bases = (
        KernelConfig(),
        KernelConfig(fp8_linear_a8_min_tokens=5, fp8_scaled_mm_min_rows=100),
        KernelConfig(fp8_linear_a8_min_tokens=300, fp8_scaled_mm_min_rows=3000),
    )
    for base in bases:
        for max_num_seqs in (1, 8, 64, 256, 300, 1024):
            for q in (1, 2, 3, 4, 5):
                k = graph_safe_kernels(base, max_num_seqs, q)
                edge = k.fp8_a8_min_tokens
                bs = decode_graph_sizes(max_num_seqs)
                assert all(b * q <= edge for b in bs), (max_num_seqs, q, edge)
                for n in range(1, PREFILL_TOKEN_BUCKETS[-1] + 1):
                    bucket = next(t for t in PREFILL_TOKEN_BUCKETS if t >= n)
                    assert (n > edge) == (bucket > edge), (max_num_seqs, q, n, edge)
                for name in ("fp8_linear_a8_min_tokens", "fp8_scaled_mm_min_rows"):
                    lin = getattr(k, name)
                    assert lin >= getattr(base, name)
                    for prev, b in zip([0] + bs, bs):
                        assert all((n * q > lin) == (b * q > lin) for n in range(prev + 1, b + 1)), (name, q, b, lin)
                    if lin >= PREFILL_TOKEN_BUCKETS[0]:
                        for n in range(1, PREFILL_TOKEN_BUCKETS[-1] + 1):
                            bucket = next(t for t in PREFILL_TOKEN_BUCKETS if t >= n)
                            assert (n > lin) == (bucket > lin), (name, max_num_seqs, q, n, lin)
    base = KernelConfig()
    assert graph_safe_kernels(base, 256, 1) is base  # nothing to raise: the same object
    assert graph_safe_kernels(base, 256, 3).fp8_a8_min_tokens == 768
    assert graph_safe_kernels(base, 256, 3).fp8_scaled_mm_min_rows == 768  # 256 inside the 96-request graph's
    assert graph_safe_kernels(KernelConfig(fp8_linear_a8_min_tokens=5), 64, 1).fp8_linear_a8_min_tokens == 8
    assert graph_safe_kernels(KernelConfig(fp8_linear_a8_min_tokens=5), 64, 3).fp8_linear_a8_min_tokens == 5  # 3 | 6
    assert graph_safe_kernels(KernelConfig(fp8_linear_a8_min_tokens=300), 8, 1).fp8_linear_a8_min_tokens == 512


def test_prefill_graphs_take_steps_on_their_buckets_side_of_the_edges():
    """A prefill graph (its bucket's tokens) takes a step of n tokens only where n and the bucket fall on the same
    side of each FP8 form edge (GraphRunner.key_for): with the linears' activation edge at 2 tokens, prefills of
    1-2 tokens run eagerly."""
    from types import SimpleNamespace

    from mlaserve.attention.base import SeqChunk
    from mlaserve.engine.cuda_graph import GraphRunner

    g = GraphRunner.__new__(GraphRunner)
    g.max_pages, g.prefill_buckets, g.bs_list = 8, [256, 512], [1, 2, 4]
    g.form_edges = (256, 2, 256)
    g.runner = SimpleNamespace()

    def key(n):
        return g.key_for([], [SeqChunk(list(range(n)), 0, [0])])

    assert [key(n) for n in (1, 2, 3, 256, 257, 512)] == [
        None,
        None,
        ("prefill", 256),
        ("prefill", 256),
        ("prefill", 512),
        ("prefill", 512),
    ]
    g.form_edges = (256, 300, 256)  # an edge inside a bucket (graph_safe_kernels never leaves one there)
    assert [key(n) for n in (299, 300, 301)] == [None, None, ("prefill", 512)]


def test_the_engine_applies_the_edge(tiny_ckpt, tmp_path):
    """Raised for a verify width of 3 at 128 requests (384 decode-graph tokens -> the 512 bucket), graphs or not."""
    from mlaserve.config import EngineConfig, SpecConfig
    from mlaserve.engine.engine import LLMEngine

    (tmp_path / "r.jsonl").write_text('{"prompt_token_ids": [1], "output_token_ids": [2]}\n')
    spec = SpecConfig.from_dict(dict(algorithm="REPLAY", num_steps=2, replay_path=str(tmp_path / "r.jsonl")))
    eng = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu", max_num_seqs=128), spec=spec)
    assert eng.cfg.kernels.fp8_a8_min_tokens == 512 and eng.runner.kernels.fp8_a8_min_tokens == 512
    plain = LLMEngine(EngineConfig(model=tiny_ckpt, device="cpu", max_num_seqs=128))
    assert plain.runner.kernels.fp8_a8_min_tokens == KernelConfig.fp8_a8_min_tokens


def test_from_env_reads_every_switch_and_refuses_bad_tiles():
    assert KernelConfig.from_env({"MLASERVE_FP8_KV_B_A8": "0"}).fp8_kv_b_a8 is False
    assert KernelConfig.from_env({"MLASERVE_FP8_KV_B_A8": "1"}).fp8_kv_b_a8 is True
    for bad in ("2:x:8:1", "2:4:8", ":::"):
        with pytest.raises(ValueError, match=f'MLASERVE_MOE_GEMV: must be "0", "1" or "n1:w1:n2:w2" .* got {bad!r}'):
            KernelConfig.from_env({"MLASERVE_MOE_GEMV": bad})
    on = KernelConfig.from_env({"MLASERVE_MOE_GEMV": "1"})
    assert on.moe_gemv and on.moe_gemv_tiles is None and on.moe_gemv_config() is True
    tiles = KernelConfig(moe_gemv_tiles=(2, 4, 8, 1)).moe_gemv_config()
    assert tiles == {"gemv1": {"BLOCK_N": 2, "num_warps": 4}, "gemv2": {"BLOCK_N": 8, "num_warps": 1}}
    assert KernelConfig(moe_gemv=False, moe_gemv_tiles=(2, 4, 8, 1)).moe_gemv_config() is False


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("gemv_serve_tokens", -1, "kernels.gemv_serve_tokens: must be an integer >= 0, got -1"),
        ("gemv_serve_tokens", 1.5, "kernels.gemv_serve_tokens: must be an integer >= 0, got 1.5"),
        ("gemv_serve_tokens", True, "kernels.gemv_serve_tokens: must be an integer >= 0, got True"),
        ("moe_a2a_min_tokens", -1, "kernels.moe_a2a_min_tokens: must be an integer >= 0, got -1"),
        ("mla_num_splits", -2, "kernels.mla_num_splits: must be an integer >= 0, got -2"),
        ("mla_num_splits", 0, "kernels.mla_num_splits: must be an integer >= 1 (or None), got 0"),
        ("mla_split_tokens", -1, "kernels.mla_split_tokens: must be an integer >= 0, got -1"),
        ("mla_split_tokens", 2.0, "kernels.mla_split_tokens: must be an integer >= 0, got 2.0"),
        ("int4_gemv_sharing", True, "kernels.int4_gemv_sharing: must be a number > 0, got True"),
        ("int4_gemv_sharing", 0, "kernels.int4_gemv_sharing: must be a number > 0, got 0"),
        ("int4_gemv_sharing", -1.5, "kernels.int4_gemv_sharing: must be a number > 0, got -1.5"),
        ("int4_gemv_sharing", "3", "kernels.int4_gemv_sharing: must be a number > 0, got '3'"),
        (
            "allreduce",
            "ring",
            "kernels.allreduce (MLASERVE_ALLREDUCE): must be one of auto, nccl, one_shot, two_shot, got 'ring'",
        ),
        (
            "moe_gemv_tiles",
            (1, 2, 3),
            "kernels.moe_gemv_tiles: must be 4 positive integers (n1, w1, n2, w2), got (1, 2, 3)",
        ),
        (
            "moe_gemv_tiles",
            (1, 2, 3, 0),
            "kernels.moe_gemv_tiles: must be 4 positive integers (n1, w1, n2, w2), got (1, 2, 3, 0)",
        ),
        (
            "moe_gemv_tiles",
            (1, 2, 3, 4.0),
            "kernels.moe_gemv_tiles: must be 4 positive integers (n1, w1, n2, w2), got (1, 2, 3, 4.0)",
        ),
    ],
)
def test_bad_values_name_the_field_the_rule_and_the_value(field, value, message):
    with pytest.raises(ValueError) as err:
        KernelConfig(**{field: value})
    assert str(err.value) == message


@pytest.mark.parametrize(
    "field,value",
    [
        ("mla_num_splits", 1),
        ("moe_a2a_min_tokens", 0),
        ("mla_split_tokens", 0),
        ("int4_gemv_sharing", 0.5),
        ("int4_gemv_sharing", 2),
        ("moe_gemv_tiles", (1, 1, 1, 1)),
        ("allreduce", "two_shot"),
    ],
)
def test_edge_values_are_accepted(field, value):
    assert getattr(KernelConfig(**{field: value}), field) == value


def test_deterministic_mode_passes_its_fixed_tiles_and_cut():
    """What the mode hands the kernels (docs/kernels.md, "Deterministic mode"): the MoE's 64-row band with BLOCK_K 64
    (its decode steps on the GPU take the bit-equal default tiles), the INT4 GEMM's one tile, MLA decode's 32 splits
    of >= 64 tokens by pointer loads; off, none of them."""
    k = KernelConfig().batch_invariant()
    gemm = dict(BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    assert k.moe_fixed_config() == dict(
        no_align=False,
        gemv=False,
        decode_tiles=True,
        tma=False,
        BLOCK_M=64,
        gemm1=dict(gemm, BLOCK_N=64),
        gemm2=dict(gemm, BLOCK_N=128),
    )
    assert k.int4_fixed_config() == dict(
        BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, TRANS=True
    )
    assert KernelConfig().int4_fixed_config() is None
    assert k.mla_decode_args() == (32, {"TMA": False, "FEW": False, "MIN_SPLIT_TOKENS": 64})
    assert KernelConfig(mla_num_splits=8).mla_decode_args() == (8, {"TMA": False, "FEW": False})
    assert KernelConfig().mla_decode_args() == (None, None)


def test_deterministic_summary_lists_pins_and_gaps():
    from mlaserve.kernel_config import DETERMINISTIC_PINS, NOT_YET_INVARIANT

    k = KernelConfig().batch_invariant()
    pins = ", ".join(f"{name}={getattr(k, name)}" for name in DETERMINISTIC_PINS)
    assert k.deterministic_summary() == (
        f"deterministic inference: pinned {pins}; MoE tiles {k.moe_fixed_config()}; "
        f"not yet batch-invariant: {'; '.join(NOT_YET_INVARIANT)}"
    )
    assert "gemv_serve_tokens=0, head_gemv_max_tokens=0, " in k.deterministic_summary()
