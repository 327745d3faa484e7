"""The INT4 experts' torch reference (tests/helpers/int4_ref.py): the packed layout against a per-element decode, the
round trip of the quantizer and compressed-tensors' own packer; the reference MoE against fused_experts_ref."""

import pytest
import torch

from tests.helpers import int4_ref


def decode_one(word: int, c: int) -> int:
    """Column c's stored nibble from its int32 word, one Python int at a time (the format's definition)."""
    return ((word & 0xFFFFFFFF) >> (4 * (c % 8))) & 0xF


def test_unpack_matches_per_element_decode():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-(2**31), 2**31, (5, 4), dtype=torch.int64, generator=g).to(torch.int32)
    packed[0, 0] = -1  # every nibble 15, the sign bit set
    packed[0, 1] = -(2**31)  # only the top nibble's top bit
    nib = int4_ref.unpack_int4(packed, 32).int() + 8  # the stored nibbles
    for r in range(5):
        for c in range(32):
            assert nib[r, c].item() == decode_one(packed[r, c // 8].item(), c), (r, c)
    assert nib[0, :8].tolist() == [15] * 8 and nib[0, 8:16].tolist() == [0] * 7 + [8]
    assert int4_ref.unpack_int4(packed, 32).dtype == torch.int8


def test_a_row_narrower_than_its_words_drops_the_padding_nibbles():
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-8, 8, (3, 24), generator=g)
    packed, scale = int4_ref.pack_int4(q), torch.rand(3, 1, generator=g).to(torch.bfloat16)
    assert torch.equal(int4_ref.unpack_int4(packed, 20), q[:, :20].to(torch.int8))
    assert torch.equal(int4_ref.dequant_int4(packed, scale, 20), q[:, :20].float() * scale.float())


def test_bad_inputs_are_refused_with_the_rule():
    r = int4_ref
    with pytest.raises(ValueError) as e:
        r.unpack_int4(torch.zeros(2, 4, dtype=torch.int64), 32)
    assert str(e.value) == "packed weights must be int32, got torch.int64"
    with pytest.raises(ValueError) as e:
        r.pack_int4(torch.zeros(2, 5, 12, dtype=torch.int64))
    assert str(e.value) == "pack_int4: in_features=12 must be a multiple of 8"
    for bad in (8, -9):
        q = torch.zeros(2, 16, dtype=torch.int64)
        q[1, 3] = bad
        with pytest.raises(ValueError) as e:
            r.pack_int4(q)
        assert str(e.value) == "pack_int4: values must lie in [-8, 7]"
    edges = torch.tensor([[-8, 7] * 4])
    assert torch.equal(r.unpack_int4(r.pack_int4(edges), 8).long(), edges)
    with pytest.raises(ValueError) as e:
        r.quantize_int4(torch.zeros(2, 5, 48))
    assert str(e.value) == "quantize_int4: in_features=48 must be a multiple of 32"


def test_pack_is_unpacks_inverse_and_dequant_rule():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (3, 6, 64), generator=g)
    r = int4_ref
    packed = r.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 6, 8)
    assert torch.equal(r.unpack_int4(packed, 64).int(), q.int())
    scale = torch.rand(3, 6, 2, generator=g).to(torch.bfloat16)
    want = q.float() * scale.float().repeat_interleave(32, -1)
    assert torch.equal(r.dequant_int4(packed, scale, 64), want)


def test_quantize_round_trip_within_half_a_step():
    r = int4_ref
    w = torch.randn(24, 96)
    w[0, :32] = 0  # an all-zero group stores zeros
    packed, scale = r.quantize_int4(w)
    got = r.dequant_int4(packed, scale, 96)
    assert torch.equal(got[0, :32], torch.zeros(32))
    assert scale[0, 0] == 0 and torch.equal(r.unpack_int4(packed, 96)[0, :32], torch.zeros(32, dtype=torch.int8))
    assert ((got - w).abs() <= scale.float().repeat_interleave(32, -1) / 2 + 1e-6).all()


def test_pack_matches_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-8, 8, (7, 96), generator=g)
    packed = int4_ref.pack_int4(q)
    assert torch.equal(helpers.pack_to_int32(q.to(torch.int8), 4), packed)
    assert torch.equal(helpers.unpack_from_int32(packed, 4, torch.Size((7, 96))).long(), q)


@pytest.mark.parametrize("offset", [0, 3])
def test_reference_moe_is_fused_experts_ref_on_dequantized_weights(offset):
    from mlaserve.layers.moe import fused_experts_ref

    r = int4_ref
    g = torch.Generator().manual_seed(3)
    T, D, I, E, K = 5, 64, 32, 6, 3
    w13p, w13s, w2p, w2s = r.random_int4_experts(E, D, I, "cpu", generator=g)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E + 4, generator=g)[:K] for _ in range(T)]) + offset - 2  # some not local
    tw = torch.rand(T, K, generator=g)
    add = torch.randn(T, D, generator=g)
    got = r.int4_fused_experts_ref(x, w13p, w13s, w2p, w2s, tw, ids.to(torch.int32), offset, add=add)
    want = fused_experts_ref(x, r.dequant_int4(w13p, w13s, D), r.dequant_int4(w2p, w2s, I), tw, ids, offset) + add
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
