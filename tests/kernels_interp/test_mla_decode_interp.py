"""mla_decode under the interpreter: tiny model dims, both page sizes, verify widths, real and empty splits."""

import pytest
import torch

from tests.kernel_checks import check_mla_decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 2, 3])
def test_tiny_model_dims(kdev, dtype, q_len):
    # R=32, P=8, H=4: the tiny preset; contexts from q_len (nothing cached) upward; page size 16
    check_mla_decode(kdev, dtype, H=4, R=32, P=8, q_len=q_len, ctx_lens=[q_len, 17, 40], page_size=16,
                     num_splits=3, config={"MIN_SPLIT_TOKENS": 16})


@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_splits_incl_empty(kdev, num_splits):
    # 7 splits of >= 16 tokens over contexts of 5..70 tokens: most splits are empty
    check_mla_decode(kdev, torch.float32, H=16, R=64, P=16, q_len=1, ctx_lens=[5, 70, 33, 1], page_size=16,
                     num_splits=num_splits, config={"MIN_SPLIT_TOKENS": 16}, strided_out=True)


def test_page64_heads_over_block(kdev):
    # H=20 spans two head blocks (the second partly masked); page size 64; default split heuristic
    check_mla_decode(kdev, torch.bfloat16, H=20, R=32, P=16, q_len=2, ctx_lens=[130, 2], page_size=64)
    check_mla_decode(kdev, torch.float32, H=1, R=16, P=16, q_len=1, ctx_lens=[3, 70], page_size=64)  # one head


def test_seq_len_zero_rows_are_zero(kdev):
    # a CUDA-graph padding request (seq_len 0) sees nothing: its rows must be zeros, not NaN
    from mlaserve.kernels.mla_decode import mla_decode
    from tests.kernel_checks import make_paged, nan_like

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
        mla_decode(q, torch.zeros(2, 16, 40, device=kdev), torch.zeros(2, 1, dtype=torch.int32, device=kdev),
                   torch.ones(2, dtype=torch.int32, device=kdev), 1, 0.1, torch.empty(3, 4, 32, device=kdev))



def test_many_splits_combine_in_r_blocks(kdev):
    # 40 splits (64-wide split tile) of a 512-wide latent: the combine tiles R in blocks of 128
    check_mla_decode(kdev, torch.float32, H=2, R=512, P=16, q_len=1, ctx_lens=[700, 50], page_size=16,
                     num_splits=40, config={"MIN_SPLIT_TOKENS": 16})


@pytest.mark.parametrize("q_len", [1, 2])
def test_tma_tiles(kdev, q_len):
    # whole tiles by tensor descriptors, the partial last tile of each split by masked loads; page size 32 with
    # 16-token tiles, contexts ending mid-tile, on a tile edge, and inside the first tile
    check_mla_decode(kdev, torch.bfloat16, H=4, R=32, P=16, q_len=q_len, ctx_lens=[q_len, 16, 47, 100],
                     page_size=32, num_splits=3, config={"TMA": True, "BLOCK_N": 16, "MIN_SPLIT_TOKENS": 16})


def test_tma_ignores_poisoned_rows_past_the_context(kdev):
    # rows past seq_len in a request's last page (stale or never written) are NaN: the output must not see them
    from mlaserve.kernels.mla_decode import mla_decode
    from mlaserve.kernels.reference import mla_decode_ref
    from tests.kernel_checks import assert_close, make_paged, nan_like

    lens = [37, 70]
    kv, table, seq_lens = make_paged(lens, 32, 48, torch.bfloat16, kdev)
    for b, L in enumerate(lens):
        last = table[b, (L - 1) // 32]
        kv[last, L % 32:] = float("nan")
    q = (0.3 * torch.randn(2, 4, 48, device=kdev)).to(torch.bfloat16)
    ref = mla_decode_ref(q, kv, table, seq_lens, 1, 0.1, 32)
    for splits, cfg in ((1, {}), (2, {"MIN_SPLIT_TOKENS": 16})):
        out = nan_like((2, 4, 32), torch.bfloat16, kdev)
        mla_decode(q, kv, table, seq_lens, 1, 0.1, out, num_splits=splits,
                   config={"TMA": True, "BLOCK_N": 16, **cfg})
        assert_close(out, ref, torch.bfloat16, f"mla_decode TMA splits={splits} with NaN rows past the context")


@pytest.mark.parametrize("dtype,page_size", [(torch.bfloat16, 16), (torch.bfloat16, 64), (torch.float32, 16)])
@pytest.mark.parametrize("q_len", [1, 2])
def test_prefetch_first_tile_bit_equal(kdev, dtype, page_size, q_len):
    # PREFETCH (each split's first KV tile loaded before the PDL wait, its new-token rows re-read after it) must give
    # the very bits of the loads-after-the-wait kernel: contexts of one token, inside / on / just past the first
    # tile (BLOCK_N 32 bf16, 16 fp32), one-tile and multi-tile splits (the loop from the second tile), a split
    # starting on the new token's tile, and empty splits (9 splits; 5 with the default one-tile minimum); the TMA
    # variant (first tile by pointer loads, whole tiles after it by descriptors, the partial one masked)
    ctx = [max(q_len, n) for n in (1, 31, 32, 33, 70, 161)]
    cfgs = [(9, {}), (1, {}), (3, {"MIN_SPLIT_TOKENS": 64}), (5, {"MIN_SPLIT_TOKENS": 16})]
    if dtype == torch.bfloat16:
        cfgs += [(4, {"TMA": True, "BLOCK_N": 16, "MIN_SPLIT_TOKENS": 32})]
    for splits, cfg in cfgs:
        check_mla_decode(kdev, dtype, H=4, R=32, P=8 if dtype == torch.float32 else 16, q_len=q_len, ctx_lens=ctx,
                         page_size=page_size, num_splits=splits, config={"PREFETCH": True, **cfg}, prefetch_ab=True)


def test_prefetch_padding_rows_and_env(kdev, monkeypatch):
    # a padding request (seq_len 0: one empty split for all) stays zeros with the first tile prefetched; the
    # engine's A/B switch MLASERVE_MLA_PREFETCH: off by default, "few" for batch 1-3, "1" everywhere
    from mlaserve.kernels import mla_decode as md
    from tests.kernel_checks import make_paged, nan_like

    kv, table, seq_lens = make_paged([33, 1], 16, 48, torch.bfloat16, kdev)
    seq_lens[1] = 0
    q = torch.randn(2, 4, 48, device=kdev).to(torch.bfloat16)
    outs = []
    for on in (True, False):
        out = nan_like((2, 4, 32), torch.bfloat16, kdev)
        md.mla_decode(q, kv, table, seq_lens, 1, 0.1, out, num_splits=3, config={"PREFETCH": on})
        assert torch.all(out[1] == 0) and not torch.isnan(out[0]).any()
        outs.append(out)
    assert torch.equal(*outs)
    try:
        for spec, want in ((None, (False, False)), ("few", (True, False)), ("1", (True, True))):
            md._prefetch_default.cache_clear()  # it reads the environment once
            if spec is None:
                monkeypatch.delenv("MLASERVE_MLA_PREFETCH", raising=False)  # off by default (session 8: no gain)
            else:
                monkeypatch.setenv("MLASERVE_MLA_PREFETCH", spec)
            assert (md._prefetch_default(True), md._prefetch_default(False)) == want, spec
    finally:
        md._prefetch_default.cache_clear()


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("q_len", [1, 2])
def test_prefetch_rereads_rows_the_store_writes_during_the_wait(kdev, monkeypatch, q_len, tma):
    # The race PREFETCH must survive, replayed in the interpreter (programs run one after another): each program's
    # start (pdl_release) puts stale NaN in this step's new-token rows, its pdl_wait writes the fresh rows, as the
    # previous kernel's KV store would. The output must be the fresh cache's, bit-equal to loading after the wait.
    if kdev != "cpu":
        pytest.skip("replays the store's race through the interpreter's PDL hooks")
    from mlaserve.kernels import mla_decode as md
    from tests.kernel_checks import make_paged, nan_like

    ctx = [q_len, 31, 32, 33, 64 + q_len - 1, 97]
    kv, table, seq_lens = make_paged(ctx, 16, 48, torch.bfloat16, kdev)
    new_rows = [(int(table[b, p // 16]), p % 16) for b, L in enumerate(ctx) for p in range(L - q_len, L)]
    fresh = {r: kv[r].clone() for r in new_rows}

    def write(stale: bool):
        for r in new_rows:
            kv[r] = float("nan") if stale else fresh[r]

    monkeypatch.setattr(md, "pdl_release", lambda PDL: write(stale=True))
    monkeypatch.setattr(md, "pdl_wait", lambda PDL: write(stale=False))
    q = (0.3 * torch.randn(len(ctx) * q_len, 4, 48, device=kdev)).to(torch.bfloat16)
    outs = []
    for on in (True, False):
        out = nan_like((len(ctx) * q_len, 4, 32), torch.bfloat16, kdev)
        md.mla_decode(q, kv, table, seq_lens, q_len, 0.1, out, num_splits=4,
                      config={"PREFETCH": on, **({"TMA": True, "BLOCK_N": 16} if tma else {})})
        outs.append(out)
    assert not torch.isnan(outs[0]).any(), "a stale (pre-wait) new-token row reached the output"
    assert torch.equal(*outs)
