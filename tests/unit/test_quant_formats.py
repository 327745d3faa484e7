"""The stored formats, against references written independently: INT4 packing equals compressed-tensors' (the library
that defines pack-quantized), dequantization is the exact fp32 product of the stored values and scales, and the
quantizers make-random uses follow the published recipes (INT4 absmax/7 per group of 32, FP8 amax/448 per block)."""

import pytest
import torch

from mlaserve.layers.quant import (
    dequant_fp8_block,
    dequant_fp8_w13,
    dequant_int4,
    pack_int4,
    quantize_fp8_block,
    quantize_int4,
    unpack_int4,
)
from tests.helpers.quant_ckpt import dequant_fp8


def test_int4_packing_equals_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 40, 96), generator=g, dtype=torch.int8)
    ours = pack_int4(q)
    theirs = helpers.pack_to_int32(q, 4)
    assert ours.dtype == theirs.dtype == torch.int32 and torch.equal(ours, theirs)
    assert torch.equal(unpack_int4(ours, 96), q)
    assert torch.equal(helpers.unpack_from_int32(ours, 4, q.shape), q)


def test_int4_nibble_layout():
    """Column c's value sits in word c // 8 at bits 4*(c % 8), stored as q + 8."""
    q = torch.full((1, 16), -8, dtype=torch.int8)
    q[0, 11] = 7  # word 1, nibble 3: 15 << 12
    words = pack_int4(q)
    assert words[0, 0].item() == 0 and words[0, 1].item() == 15 << 12


def test_int4_dequant_is_the_exact_product():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)
    scale = (torch.rand(24, 2, generator=g) + 0.1).to(torch.bfloat16)
    got = dequant_int4(pack_int4(q), scale, 64)
    want = torch.empty(24, 64)
    for r in range(24):
        for c in range(64):
            want[r, c] = float(q[r, c]) * float(scale[r, c // 32])
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_int4_quantizer():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5, 2, 96, generator=g)
    w[0, 0, :32] = 0  # an all-zero group stores zeros
    packed, scale = quantize_int4(w)
    assert packed.shape == (5, 2, 12) and scale.shape == (5, 2, 3) and scale.dtype == torch.bfloat16
    groups = w.unflatten(-1, (3, 32))
    torch.testing.assert_close(scale, (groups.abs().amax(-1) / 7).to(torch.bfloat16), rtol=0, atol=0)
    q = unpack_int4(packed, 96)
    assert q.min() >= -7 and q.max() <= 7  # absmax/7: no value clips
    err = (dequant_int4(packed, scale, 96) - w).abs()
    assert (err <= scale.float().repeat_interleave(32, -1) * 0.5 + 1e-6).all()
    assert (dequant_int4(packed, scale, 96)[0, 0, :32] == 0).all()


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (576, 7), (40, 64)])
def test_fp8_block_dequant(shape):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-shape[0] // 128), -(-shape[1] // 128), generator=g) + 0.5
    got = dequant_fp8_block(w, scale)
    assert got.dtype == torch.float32 and torch.equal(got, dequant_fp8(w, scale))


def test_fp8_quantizer():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 200, generator=g) * torch.rand(300, 1, generator=g)
    w[256:, 128:] = 0  # a zero block
    q, scale = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert scale[i, j].item() == pytest.approx(blk.abs().max().item() / 448, rel=1e-6)
    back = dequant_fp8_block(q, scale)
    # round to nearest in e4m3: half a step of 3 mantissa bits, or of the subnormals (2^-9) near zero
    full = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((back - w).abs() <= 2**-4 * w.abs() + 2**-10 * full + 1e-12).all()
    assert (back[256:, 128:] == 0).all()


@pytest.mark.parametrize("inter", [160, 256, 32])
def test_fp8_w13_split_half_scales(inter):
    """w13 = [gate; up] of an expert, each with its own block rows: row n uses block row n // 128 (gate) or
    ceil(I/128) + (n - I) // 128 (up)."""
    g = torch.Generator().manual_seed(5)
    D = 200
    gate, up = (torch.randn(inter, D, generator=g) for _ in range(2))
    (qg, sg), (qu, su) = quantize_fp8_block(gate), quantize_fp8_block(up)
    w13, s13 = torch.cat([qg, qu]), torch.cat([sg, su])
    assert s13.shape == (2 * -(-inter // 128), 2)
    want = torch.cat([dequant_fp8(qg, sg), dequant_fp8(qu, su)])
    assert torch.equal(dequant_fp8_w13(w13[None], s13[None])[0], want)
