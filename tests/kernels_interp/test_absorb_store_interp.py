"""absorb_q_rope_store_kv under the interpreter: the KV store (kv_a_layernorm + RoPE of k_pe into the paged cache)
as one more program of absorb_q_rope's launch, against absorb_q_rope and rope_store_kv (tests/helpers/kernel_checks)."""

import pytest
import torch

from tests.helpers.kernel_checks import check_absorb_q_rope_store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("T", [1, 2])
def test_absorb_q_rope_store_kv(kdev, dtype, norm, pad, T):
    check_absorb_q_rope_store_kv(kdev, dtype, T=T, H=4, N=16, R=32, P=8, norm=norm, pad=pad)


@pytest.mark.parametrize("T", [1, 2])
def test_absorb_q_rope_store_kv_model_head_dims(kdev, T):
    # N=128, R=512, P=64 as every DeepSeek-V3-family model has them, page size 64, two heads
    check_absorb_q_rope_store_kv(
        kdev, torch.bfloat16, T=T, H=2, N=128, R=512, P=64, norm=True, pad=False, page_size=64, num_pages=2, V=128
    )


def test_absorb_q_rope_store_kv_checks(kdev):
    from mlaserve.kernels.head_gemv import absorb_q_rope_store_kv

    H, N, R, P, T = 2, 16, 32, 8, 2
    w_kc = torch.randn(H, N, R, device=kdev)
    q, Q = torch.randn(T, H, N + P, device=kdev), torch.empty(T, H, R + P, device=kdev)
    cos, sin = torch.randn(T, P // 2, device=kdev), torch.randn(T, P // 2, device=kdev)
    cache, slots = torch.empty(2, 16, R + P, device=kdev), torch.arange(T, device=kdev)
    kv_a = torch.randn(T, R + P, device=kdev)
    c_kv, k_pe = kv_a[:, :R], kv_a[:, R:]

    def call(**kw):
        args = dict(q=q, w_kc=w_kc, cos=cos, sin=sin, Q=Q, kv_cache=cache, slot_mapping=slots, c_kv=c_kv, k_pe=k_pe)
        absorb_q_rope_store_kv(**(args | kw))

    with pytest.raises(ValueError, match=r"c_kv .* must be \[T, R\]"):
        call(c_kv=c_kv[:, :16])
    with pytest.raises(ValueError, match=r"c_kv .* must be \[T, R\]"):
        call(c_kv=c_kv[:1])
    with pytest.raises(ValueError, match="k_pe .* q's P"):
        call(k_pe=k_pe[:, :4])
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=slots.int())
    with pytest.raises(ValueError, match="kv_cache"):
        call(kv_cache=torch.empty(2, 16, R + P + 2, device=kdev))
    with pytest.raises(ValueError, match="page_size=12"):
        call(kv_cache=torch.empty(2, 12, R + P, device=kdev))
    with pytest.raises(ValueError, match="norm_weight"):
        call(norm_weight=torch.ones(R, device=kdev, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="1..2 tokens"):
        absorb_q_rope_store_kv(
            q.repeat(2, 1, 1)[:3],
            w_kc,
            cos[:1].repeat(3, 1),
            sin[:1].repeat(3, 1),
            torch.empty(3, H, R + P, device=kdev),
            cache,
            torch.arange(3, device=kdev),
            kv_a.repeat(2, 1)[:3, :R],
            kv_a.repeat(2, 1)[:3, R:],
        )
