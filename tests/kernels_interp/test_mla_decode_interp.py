"""mla_decode under the interpreter: tiny model dims, both page sizes, verify widths, real and empty splits."""

import pytest
import torch

from tests.helpers.kernel_checks import check_mla_decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 2, 3])
def test_tiny_model_dims(kdev, dtype, q_len):
    # R=32, P=8, H=4: the tiny preset; contexts from q_len (nothing cached) upward; page size 16
    check_mla_decode(
        kdev,
        dtype,
        H=4,
        R=32,
        P=8,
        q_len=q_len,
        ctx_lens=[q_len, 17, 40],
        page_size=16,
        num_splits=3,
        config={"MIN_SPLIT_TOKENS": 16},
    )


@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_splits_incl_empty(kdev, num_splits):
    # 7 splits of >= 16 tokens over contexts of 5..70 tokens: most splits are empty
    check_mla_decode(
        kdev,
        torch.float32,
        H=16,
        R=64,
        P=16,
        q_len=1,
        ctx_lens=[5, 70, 33, 1],
        page_size=16,
        num_splits=num_splits,
        config={"MIN_SPLIT_TOKENS": 16},
        strided_out=True,
    )


def test_page64_heads_over_block(kdev):
    # H=20 spans two head blocks (the second partly masked); page size 64; default split heuristic
    check_mla_decode(kdev, torch.bfloat16, H=20, R=32, P=16, q_len=2, ctx_lens=[130, 2], page_size=64)
    check_mla_decode(kdev, torch.float32, H=1, R=16, P=16, q_len=1, ctx_lens=[3, 70], page_size=64)  # one head


def test_seq_len_zero_rows_are_zero(kdev):
    # a CUDA-graph padding request (seq_len 0) sees nothing: its rows must be zeros, not NaN
    from mlaserve.kernels.mla_decode import mla_decode
    from tests.helpers.kernel_checks import make_paged, nan_like

    kv, table, seq_lens = make_paged([9, 1], 16, 40, torch.float32, kdev)
    seq_lens[1] = 0
    q = torch.randn(2, 4, 40, device=kdev)
    for splits in (1, 3):
        out = nan_like((2, 4, 32), torch.float32, kdev)
        mla_decode(q, kv, table, seq_lens, 1, 0.1, out, num_splits=splits, config={"MIN_SPLIT_TOKENS": 16})
        assert torch.all(out[1] == 0) and not torch.isnan(out[0]).any()


def test_bad_input_names_field(kdev):
    from mlaserve.kernels.mla_decode import mla_decode

    q = torch.zeros(3, 4, 40, device=kdev)
    with pytest.raises(ValueError, match="B \\* q_len"):
        mla_decode(
            q,
            torch.zeros(2, 16, 40, device=kdev),
            torch.zeros(2, 1, dtype=torch.int32, device=kdev),
            torch.ones(2, dtype=torch.int32, device=kdev),
            1,
            0.1,
            torch.empty(3, 4, 32, device=kdev),
        )


def test_many_splits_combine_in_r_blocks(kdev):
    # 40 splits (64-wide split tile) of a 512-wide latent: the combine tiles R in blocks of 128
    check_mla_decode(
        kdev,
        torch.float32,
        H=2,
        R=512,
        P=16,
        q_len=1,
        ctx_lens=[700, 50],
        page_size=16,
        num_splits=40,
        config={"MIN_SPLIT_TOKENS": 16},
    )


@pytest.mark.parametrize("q_len", [1, 2])
def test_tma_tiles(kdev, q_len):
    # whole tiles by tensor descriptors, the partial last tile of each split by masked loads; page size 32 with
    # 16-token tiles, contexts ending mid-tile, on a tile edge, and inside the first tile
    check_mla_decode(
        kdev,
        torch.bfloat16,
        H=4,
        R=32,
        P=16,
        q_len=q_len,
        ctx_lens=[q_len, 16, 47, 100],
        page_size=32,
        num_splits=3,
        config={"TMA": True, "BLOCK_N": 16, "MIN_SPLIT_TOKENS": 16},
    )


def test_tma_ignores_poisoned_rows_past_the_context(kdev):
    # rows past seq_len in a request's last page (stale or never written) are NaN: the output must not see them
    from mlaserve.kernels.mla_decode import mla_decode
    from tests.helpers.kernel_checks import assert_close, make_paged, nan_like
    from tests.helpers.kernel_refs import mla_decode_ref

    lens = [37, 70]
    kv, table, seq_lens = make_paged(lens, 32, 48, torch.bfloat16, kdev)
    for b, L in enumerate(lens):
        last = table[b, (L - 1) // 32]
        kv[last, L % 32 :] = float("nan")
    q = (0.3 * torch.randn(2, 4, 48, device=kdev)).to(torch.bfloat16)
    ref = mla_decode_ref(q, kv, table, seq_lens, 1, 0.1, 32)
    for splits, cfg in ((1, {}), (2, {"MIN_SPLIT_TOKENS": 16})):
        out = nan_like((2, 4, 32), torch.bfloat16, kdev)
        mla_decode(q, kv, table, seq_lens, 1, 0.1, out, num_splits=splits, config={"TMA": True, "BLOCK_N": 16, **cfg})
        assert_close(out, ref, torch.bfloat16, f"mla_decode TMA splits={splits} with NaN rows past the context")


def test_plan_batch_rows_equal_the_padded_batch(kdev):
    """3 requests planned as 4 (an eager step as its padded CUDA-graph twin): bit for bit the first 3 requests'
    rows of the 4-request call, whose 4th is graph padding; planned as 3 they take other splits and tiles."""
    from mlaserve.kernels.mla_decode import mla_decode, split_plan
    from tests.helpers.kernel_checks import make_paged, nan_like

    H, R, P = 16, 32, 16
    assert (
        split_plan(3, H, 1, torch.bfloat16, torch.device("cpu"))[:2]
        != split_plan(4, H, 1, torch.bfloat16, torch.device("cpu"))[:2]
    )
    kv, table, seq_lens = make_paged([300, 41, 129, 1], 16, R + P, torch.bfloat16, kdev)
    seq_lens[3] = 1  # padding: seq_len = q_len, a zero page-table row
    table[3] = 0
    q = torch.randn(4, H, R + P, device=kdev).to(torch.bfloat16)
    padded = nan_like((4, H, R), torch.bfloat16, kdev)
    mla_decode(q, kv, table, seq_lens, 1, 0.1, padded)
    planned, own = nan_like((3, H, R), torch.bfloat16, kdev), nan_like((3, H, R), torch.bfloat16, kdev)
    mla_decode(q[:3], kv, table[:3], seq_lens[:3], 1, 0.1, planned, plan_batch=4)
    mla_decode(q[:3], kv, table[:3], seq_lens[:3], 1, 0.1, own)
    assert torch.equal(planned, padded[:3])
    assert not torch.isnan(own).any() and torch.allclose(own.float(), planned.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="plan_batch"):
        mla_decode(q[:3], kv, table[:3], seq_lens[:3], 1, 0.1, own, plan_batch=2)
