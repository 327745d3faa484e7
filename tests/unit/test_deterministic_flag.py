"""--deterministic-inference / LLM(deterministic=True): the flag reaches EngineConfig, which pins the kernels every
rank gets (KernelConfig.batch_invariant); the default leaves them as they were."""

import argparse
import dataclasses
import logging

from mlaserve.args import add_engine_args, engine_kwargs_from_args
from mlaserve.config import EngineConfig
from mlaserve.kernel_config import DETERMINISTIC_PINS, KernelConfig


def _kw(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_kwargs_from_args(p.parse_args(argv))


def test_flag_and_its_sglang_name_reach_engine_config():
    assert _kw([])["deterministic"] is False
    for flag in ("--deterministic-inference", "--enable-deterministic-inference"):
        kw = _kw([flag])
        assert kw["deterministic"] is True
        cfg = EngineConfig(model="m", **kw)
        cfg.validate()
        assert cfg.kernels.deterministic and cfg.kernels == KernelConfig.from_env().batch_invariant()


def test_default_kernels_unchanged():
    cfg = EngineConfig(model="m")
    assert not cfg.deterministic and cfg.kernels == KernelConfig.from_env() and not cfg.kernels.deterministic
    assert KernelConfig().mla_decode_args() == (None, None) and KernelConfig().moe_fixed_config() is None


def test_pins_survive_replace_and_the_graph_edge():
    from mlaserve.engine.cuda_graph import graph_safe_kernels

    cfg = EngineConfig(model="m", deterministic=True)
    again = dataclasses.replace(cfg, max_num_seqs=7)
    assert again.kernels == cfg.kernels  # not pinned twice, not lost
    assert dataclasses.replace(cfg, kernels=KernelConfig()).kernels.deterministic  # the flag re-pins new kernels
    k = graph_safe_kernels(cfg.kernels, max_num_seqs=256, decode_q_len=4)
    assert k.fp8_a8_min_tokens == 0  # W8A8 at every size: no edge for a padded graph step to cross
    for name, v in DETERMINISTIC_PINS.items():
        assert getattr(k, name) == v, name
    # the switches that change no result stay as the environment set them
    env = KernelConfig.from_env({"MLASERVE_PDL": "0"})
    assert env.batch_invariant().pdl is False and env.batch_invariant().moe_tma is True


def test_engine_config_pickles_with_its_pins():
    """Ranks > 0 receive rank 0's EngineConfig by pickling: the pinned kernels travel with it."""
    import pickle

    cfg = pickle.loads(pickle.dumps(EngineConfig(model="m", deterministic=True)))
    assert cfg.deterministic and cfg.kernels.deterministic and cfg.kernels.mla_num_splits == 32


def test_llm_deterministic_logs_what_it_pins(tiny_ckpt, caplog):
    from mlaserve.llm import LLM
    from mlaserve.types import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="mlaserve"):
        llm = LLM(tiny_ckpt, device="cpu", deterministic=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("deterministic inference:")]
    assert len(lines) == 1, lines
    assert "router_splitk_max_tokens=0" in lines[0] and "not yet batch-invariant: FP8 linears" in lines[0]
    assert llm.engine_config.kernels.deterministic
    got = llm.generate([[1, 2, 3, 4]], params)[0].token_ids
    plain = LLM(tiny_ckpt, device="cpu").generate([[1, 2, 3, 4]], params)[0].token_ids
    assert got == plain  # the CPU reference path is unchanged by the mode


def test_a_linear_outside_bi_gemm_is_logged_once_per_shape(caplog):
    """Deterministic mode's cuBLAS fall-back (a weight in another dtype than its input) is said, once a shape."""
    import logging

    import torch

    from mlaserve.layers import linear

    linear._FALLBACKS.clear()
    x, w = torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="mlaserve.linear"):
        for _ in range(3):
            linear._warn_fallback(x, w)
        linear._warn_fallback(x, torch.zeros(5, 8, dtype=torch.float64))
    lines = [r.getMessage() for r in caplog.records if "cuBLAS" in r.getMessage()]
    assert len(lines) == 2 and "(4, 8)" in lines[0] and "(5, 8)" in lines[1]
