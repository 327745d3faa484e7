"""race_sample under the interpreter: the fused sampling filters and race against the reference
(helpers/kernel_checks)."""

import pytest

from tests.helpers.kernel_checks import check_race_sample


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the NaN rows, as the GPU does silently
@pytest.mark.parametrize("R,V", [(3, 7), (65, 300), (17, 5000)])
def test_race_sample(kdev, R, V):
    check_race_sample(kdev, R=R, V=V)


def test_race_into_kernel_equals_reference(kdev):
    """sampler.race_into with the race kernel gives its reference path's tokens, from the same logits and noise:
    the kernel's params (which field is which, each row's logit and noise rows, the rows left to the reference:
    top-k with top-p) are what the reference reads; rows not named stay untouched."""
    import torch

    from mlaserve.layers.sampler import race_into, race_noise
    from mlaserve.types import SamplingParams
    from tests.helpers.kernel_checks import sampling_rows

    flat = [SamplingParams(temperature=1.0, top_k=4, top_p=0.7)] * 16  # flat rows: the top-k set's mass is small
    g = torch.Generator().manual_seed(7)
    V = 500
    logits = torch.randn(26, V, generator=g) * 3
    logits[10:] *= 0.1  # top-p over the top-k set's renormalised mass keeps fewer of the 4 than over the row's
    logits = logits.to(kdev)
    idx = [9, 0, 4, 2, 7, 5, 1] + list(range(10, 26))  # the sampled rows' places; 3, 6, 8 are not sampled

    def run(kernel):
        rows = sampling_rows(kdev, greedy=False, extra=flat)
        noise = race_noise(rows, 1, V, torch.Generator(device=kdev).manual_seed(3), kdev)
        out = torch.full((26,), -1, dtype=torch.int64, device=kdev)
        race_into(out, logits, rows, idx, noise, kernel=kernel)
        return out

    a, b = run(True), run(False)
    assert torch.equal(a, b), (a.tolist(), b.tolist())
    assert [int(a[i]) for i in (3, 6, 8)] == [-1, -1, -1] and (a[idx] >= 0).all()


@pytest.mark.parametrize(
    "kind",
    [
        dict(temperature=2.0, top_k=1),
        dict(temperature=1.5, top_k=3),
        dict(temperature=1.0, top_p=0.3),
        dict(temperature=1.0, min_p=0.5),
    ],
    ids=["top_k_1", "top_k_3", "top_p", "min_p"],
)
def test_race_into_kernel_one_filter_a_batch(kdev, kind):
    """A batch whose rows all use one filter (so the kernel's check and min-p flags see only that one) gives the
    reference path's tokens: on near-flat rows each filter drops most of the mass, so a filter skipped shows."""
    import torch

    from mlaserve.layers.sampler import SamplingRow, race_into, race_noise
    from mlaserve.types import SamplingParams

    R, V = 24, 200
    logits = (torch.randn(R, V, generator=torch.Generator().manual_seed(5)) * 0.3).to(kdev)
    rows = [SamplingRow(SamplingParams(**kind), None)] * R

    def run(kernel):
        noise = race_noise(rows, 1, V, torch.Generator(device=kdev).manual_seed(4), kdev)
        out = torch.full((R,), -1, dtype=torch.int64, device=kdev)
        race_into(out, logits, rows, list(range(R)), noise, kernel=kernel)
        return out

    a, b = run(True), run(False)
    assert torch.equal(a, b), (a.tolist(), b.tolist())
