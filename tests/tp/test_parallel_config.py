"""ParallelConfig: the --tp shorthand, rank layout, and sizes refused at start with the reason."""

import argparse

import pytest

from mlaserve.args import add_parallel_args, parallel_config_from_args
from mlaserve.config import ModelConfig, ParallelConfig
from mlaserve.models.make_random import load_preset


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.from_hf(load_preset("tiny"))


def sizes(p: ParallelConfig) -> tuple[int, int, int]:
    return p.attn_tp_size, p.moe_tp_size, p.ep_size


def test_tp_shorthand():
    assert sizes(ParallelConfig.from_tp()) == (1, 1, 1)
    assert sizes(ParallelConfig.from_tp(2)) == (2, 2, 1)
    assert sizes(ParallelConfig.from_tp(2, ep_size=2)) == (2, 1, 2)
    assert sizes(ParallelConfig.from_tp(attn_tp_size=4, moe_tp_size=2)) == (4, 2, 2)
    assert sizes(ParallelConfig.from_tp(8, moe_tp_size=2, ep_size=4)) == (8, 2, 4)
    with pytest.raises(ValueError, match="tp=2 and attn_tp_size=4 disagree"):
        ParallelConfig.from_tp(2, attn_tp_size=4)


def test_cli_flags():
    p = argparse.ArgumentParser()
    add_parallel_args(p)
    args = p.parse_args(
        ["--tp", "4", "--ep-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:29500"]
    )
    par = parallel_config_from_args(args)
    assert sizes(par) == (4, 2, 2) and (par.nnodes, par.node_rank, par.dist_init_addr) == (2, 1, "10.0.0.1:29500")


def test_rank_layout():
    par = ParallelConfig(4, 2, 2, nnodes=2, node_rank=1, dist_init_addr="h:1")
    assert (par.world_size, par.local_world_size, par.global_rank(0), par.global_rank(1)) == (4, 2, 2, 3)
    infos = [par.rank_info(r) for r in range(4)]
    assert [(i.moe_tp_rank, i.ep_rank) for i in infos] == [(0, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize(
    "kw, msg",
    [
        (
            dict(attn_tp_size=2, moe_tp_size=1, ep_size=1),
            r"moe_tp_size \* ep_size \(1 \* 1 = 1\) must equal attn_tp_size \(2\).*--moe-tp-size x --ep-size",
        ),
        (dict(attn_tp_size=0), r"attn_tp_size \(--attn-tp-size\) must be a positive integer, got 0"),
        (
            dict(attn_tp_size=3, moe_tp_size=3, nnodes=2, dist_init_addr="h:1"),
            "world size 3 .* not divisible by nnodes=2 .--nnodes",
        ),
        (
            dict(nnodes=2, node_rank=2, attn_tp_size=2, moe_tp_size=2, dist_init_addr="h:1"),
            r"node_rank \(--node-rank\) must be in \[0, nnodes=2\)",
        ),
        (dict(nnodes=2, attn_tp_size=2, moe_tp_size=2), "nnodes=2 needs dist_init_addr .--dist-init-addr"),
        (dict(dist_init_addr="10.0.0.1"), r"--dist-init-addr\) must be host:port .* got '10.0.0.1'"),
        (dict(dist_init_addr="10.0.0.1:99999"), "port 1-65535"),
        (dict(dist_init_addr=":29500"), "must be host:port"),
        (dict(dist_init_timeout_s=0), r"dist_init_timeout_s \(--dist-init-timeout\) must be > 0"),
    ],
)
def test_bad_layouts_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelConfig(**kw)


@pytest.mark.parametrize(
    "sizes_, change, msg",
    [
        ((8, 1, 8), {}, r"attn_tp_size=8 \(--attn-tp-size\) does not divide num_attention_heads=4"),
        ((4, 1, 4), dict(n_routed_experts=6, n_group=1), r"ep_size=4 \(--ep-size\) does not divide n_routed_experts=6"),
        ((4, 4, 1), dict(moe_intermediate_size=34), r"moe_tp_size=4 \(--moe-tp-size\) does not divide moe_inter"),
        ((4, 4, 1), dict(intermediate_size=130), r"=4 \(--attn-tp-size / --tp\) does not divide intermediate_size=130"),
        ((4, 2, 2), dict(moe_intermediate_size=34), r"=4 .* does not divide the shared experts' intermediate size=34"),
    ],
)
def test_sizes_that_do_not_divide_are_refused(tiny, sizes_, change, msg):
    par = ParallelConfig(*sizes_)
    with pytest.raises(ValueError, match=msg):
        par.validate(tiny.replace(**change))


def test_dist_init_addr_forms_accepted():
    for addr in ("10.0.0.1:29500", "node0.cluster:1", "[::1]:29500", "tcp://10.0.0.1:29500", "env://", "file:///tmp/x"):
        assert ParallelConfig(dist_init_addr=addr).dist_init_addr == addr


def _splits(par: ParallelConfig, cfg: ModelConfig) -> dict[str, int]:
    """What each rank of an accepted layout holds: every split exact (the product back to the whole)."""
    out = dict(
        heads=cfg.num_attention_heads // par.attn_tp_size,
        experts=cfg.n_routed_experts // par.ep_size,
        expert_inter=cfg.moe_intermediate_size // par.moe_tp_size,
    )
    assert out["heads"] * par.attn_tp_size == cfg.num_attention_heads
    assert out["experts"] * par.ep_size == cfg.n_routed_experts
    assert out["expert_inter"] * par.moe_tp_size == cfg.moe_intermediate_size
    # each rank one (moe-TP, EP) cell of the grid, every cell once
    cells = {(par.rank_info(r).moe_tp_rank, par.rank_info(r).ep_rank) for r in range(par.world_size)}
    assert cells == {(t, e) for t in range(par.moe_tp_size) for e in range(par.ep_size)}
    return out


def test_valid_sizes_pass(tiny):
    assert ParallelConfig(2, 2, 1).validate(tiny) is None
    assert _splits(ParallelConfig(2, 2, 1), tiny) == dict(heads=2, experts=8, expert_inter=16)
    assert ParallelConfig(2, 1, 2).validate(tiny) is None
    assert _splits(ParallelConfig(2, 1, 2), tiny) == dict(heads=2, experts=4, expert_inter=32)
    assert ParallelConfig(2, 2, 1).validate(tiny.replace(vocab_size=509)) is None  # the vocab is padded: any size
    kimi = ModelConfig.from_hf(load_preset("kimi-k2.5"))
    want = {
        (8, 8, 1): dict(heads=8, experts=384, expert_inter=256),
        (8, 1, 8): dict(heads=8, experts=48, expert_inter=2048),
        (16, 16, 1): dict(heads=4, experts=384, expert_inter=128),
    }
    for par in (ParallelConfig.from_tp(8), ParallelConfig.from_tp(8, ep_size=8), ParallelConfig.from_tp(16)):
        assert par.validate(kimi) is None
        assert _splits(par, kimi) == want[sizes(par)]
