"""Which all-reduce runs for which message (distributed/allreduce.py), on the CPU: sizes against the thresholds per
world size, dtypes, layouts, graph capture, forced backends, and the fallbacks when symmetric memory is unavailable
(on any rank: every rank then takes NCCL/gloo)."""

import pytest
import torch

from mlaserve.config import ParallelConfig
from mlaserve.distributed import allreduce, tp
from mlaserve.distributed.allreduce import AllReduceConfig, KiB, MiB, is_aligned, select, unavailable
from mlaserve.distributed.launch import launch
from mlaserve.distributed.tp import RankInfo
from mlaserve.kernel_config import KernelConfig

from . import ranks

BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16
AUTO = AllReduceConfig()
HIDDEN = 7168 * 2  # bytes of one bf16 row of Kimi-K2.5's hidden state


def pick(nbytes, world=2, dtype=BF16, cfg=AUTO, symm_ready=True, aligned=True, capturing=True):
    return select(cfg, nbytes, world, dtype, symm_ready=symm_ready, aligned=aligned, capturing=capturing)


@pytest.mark.parametrize("world, one, two", [(2, 512 * KiB, 8 * MiB), (4, 512 * KiB, 8 * MiB), (8, 256 * KiB, 8 * MiB)])
def test_sizes_against_the_thresholds(world, one, two):
    assert pick(16, world) == "one_shot"
    assert pick(8 * HIDDEN, world) == "one_shot"  # the decode-sized message: batch 8 x 7168 bf16 = 112 KiB
    assert pick(one, world) == "one_shot"
    assert pick(one + 16, world) == "two_shot"
    assert pick(two, world) == "two_shot"
    assert pick(two + 16, world) == "nccl"  # larger than the symmetric buffer: prefill-sized
    assert pick(8192 * HIDDEN, world) == "nccl"


def test_world_sizes_without_a_threshold_or_a_two_shot_kernel():
    assert pick(16, world=3) == "nccl" and pick(16, world=6) == "nccl"  # no table entry: NCCL
    six = AllReduceConfig(one_shot_max_bytes=((6, 64 * KiB),), two_shot_max_bytes=((6, 8 * MiB),))
    assert pick(64 * KiB, world=6, cfg=six) == "one_shot"  # one-shot runs at any world size
    assert pick(1 * MiB, world=6, cfg=six) == "nccl"  # torch's two-shot kernel exists for 2, 4 and 8 ranks only
    assert pick(16, world=1) == "nccl"


def test_dtypes_and_layouts():
    assert pick(4 * KiB, dtype=F32) == "one_shot"
    assert pick(4 * KiB, dtype=F16) == "nccl"  # torch's symmetric-memory sums dispatch on bf16 and fp32 only
    assert pick(4 * KiB, aligned=False) == "nccl"
    x = torch.zeros(8, 7168, dtype=BF16)
    assert is_aligned(x) and is_aligned(x[1:]) and is_aligned(x[2:4])
    assert not is_aligned(x[:, :64]) and not is_aligned(x.t())  # not contiguous
    assert not is_aligned(torch.zeros(9, dtype=BF16)[1:])  # offset 2 bytes
    assert not is_aligned(torch.zeros(7, dtype=BF16))  # 14 bytes


def test_graph_capture_state():
    assert pick(4 * KiB, capturing=False) == "one_shot"  # eager decode steps take it too by default
    graphs_only = AllReduceConfig(eager=False)
    assert pick(4 * KiB, cfg=graphs_only, capturing=True) == "one_shot"
    assert pick(4 * KiB, cfg=graphs_only, capturing=False) == "nccl"


def test_forced_backends_and_fallbacks():
    assert pick(4 * MiB, cfg=AllReduceConfig(backend="one_shot")) == "one_shot"
    assert pick(16, cfg=AllReduceConfig(backend="two_shot")) == "two_shot"
    assert pick(16, cfg=AllReduceConfig(backend="nccl")) == "nccl"
    assert pick(9 * MiB, cfg=AllReduceConfig(backend="one_shot")) == "nccl"  # beyond the buffer: still NCCL
    assert pick(16, symm_ready=False) == "nccl"  # symmetric memory unavailable (on any rank)
    assert pick(16, world=6, cfg=AllReduceConfig(backend="two_shot")) == "nccl"


def test_config_from_env_validation_and_description():
    """MLASERVE_ALLREDUCE is read by KernelConfig.from_env (the one reader of the environment)."""
    assert AllReduceConfig.from_kernels(KernelConfig.from_env({})) == AUTO
    assert AllReduceConfig.from_kernels(KernelConfig.from_env({"MLASERVE_ALLREDUCE": "nccl"})).backend == "nccl"
    with pytest.raises(ValueError, match="MLASERVE_ALLREDUCE.*must be one of auto, nccl, one_shot, two_shot"):
        KernelConfig.from_env({"MLASERVE_ALLREDUCE": "multimem"})
    with pytest.raises(ValueError, match="all-reduce backend: must be one of auto, nccl, one_shot, two_shot"):
        AllReduceConfig(backend="multimem")
    with pytest.raises(ValueError, match=r"one_shot_max_bytes: \(1, 16\) needs a world >= 2"):
        AllReduceConfig(one_shot_max_bytes=((1, 16),))
    assert AUTO.buffer_bytes(2) == 8 * MiB and AUTO.buffer_bytes(3) == 0
    assert AUTO.describe(8) == "one-shot <= 256 KiB, two-shot <= 8192 KiB, NCCL above (world 8)"
    assert AUTO.describe(3) == "NCCL only (backend auto, world 3)"


def test_why_symmetric_memory_is_unavailable():
    cpu = torch.device("cpu")
    assert unavailable(AllReduceConfig(backend="nccl"), cpu, 2, 1) == "MLASERVE_ALLREDUCE=nccl"
    assert unavailable(AUTO, cpu, 3, 1) == "no threshold for world size 3"
    assert "2 nodes" in unavailable(AUTO, cpu, 2, 2)
    assert unavailable(AUTO, cpu, 2, 1) == "device cpu"


class _Fake:
    def __init__(self, takes: bool):
        self.takes, self.seen = takes, []

    def try_all_reduce(self, x):
        self.seen.append(x.shape)
        return self.takes


def test_tp_all_reduce_dispatches(monkeypatch):
    """tp.all_reduce asks the symmetric-memory path first and runs the group's all_reduce only when it declines."""
    group_calls = []
    monkeypatch.setattr(tp.dist, "all_reduce", lambda x, group=None: group_calls.append(x.shape))
    try:
        for takes in (True, False):
            fake = _Fake(takes)
            tp.set_group(None, RankInfo(rank=0, world_size=2), symm=fake)
            x = torch.ones(2, 4)
            assert tp.all_reduce(x) is x
            assert fake.seen == [(2, 4)]
        assert group_calls == [(2, 4)]  # only the declined call
    finally:
        tp.set_group(None, RankInfo())


def test_gloo_ranks_agree_and_keep_the_plain_path():
    """Two gloo ranks: symmetric memory is set up nowhere (CPU), a rank that says no makes every rank say no, and
    tp.all_reduce still sums."""
    out = launch(ParallelConfig(2, 2, 1), ranks.allreduce_fallback, timeout_s=120, start_method="forkserver")
    assert out == [(False, False, True, 3.0), (False, False, True, 3.0)]


def test_agree_is_a_min(monkeypatch):
    monkeypatch.setattr(allreduce.dist, "all_reduce", lambda t, op=None, group=None: t.fill_(0))
    assert allreduce.agree(True, None) is False


def test_deterministic_all_reduce_sums_in_rank_order_at_every_size():
    """Deterministic mode, three gloo ranks: every message's rows are the fp32 sum in rank order rounded once (the
    same bits whatever the message's size), and every rank holds the same bits."""
    out = launch(ParallelConfig(3, 3, 1), ranks.ordered_all_reduce, timeout_s=120, start_method="forkserver")
    for per_rank in out:
        for got, ref in per_rank:
            assert torch.equal(got, ref)
    for per_rank in out[1:]:
        assert all(torch.equal(a[0], b[0]) for a, b in zip(per_rank, out[0]))
