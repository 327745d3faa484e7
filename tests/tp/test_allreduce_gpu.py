"""The symmetric-memory all-reduces against NCCL on GPUs (run by the lead on a multi-GPU machine):
one-shot and two-shot, bf16 and fp32, 1-300 rows of 7168, eager and replayed from a CUDA graph."""

import pytest
import torch

from mlaserve.config import ParallelConfig
from mlaserve.distributed.launch import launch

from . import ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_symmetric_memory_all_reduce_matches_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = launch(
        ParallelConfig(world, world, 1), ranks.allreduce_vs_nccl, device="cuda", timeout_s=300, collective_timeout_s=120
    )
    for rank_rows in results:
        for r in rank_rows:
            assert r["same_on_all_ranks"], r  # every rank must feed the same values to the next layer
            assert r["err"] <= 0 and r["nccl_err"] <= 0, r  # within rounding of the fp64 sum, like NCCL
            if world == 2:  # one add of two values: correctly rounded either way
                assert r["bit_equal"], r
