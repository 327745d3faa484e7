"""race_sample under the interpreter: the fused sampling filters and race against the reference
(helpers/kernel_checks)."""

import pytest

from tests.helpers.kernel_checks import check_race_sample


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the NaN rows, as the GPU does silently
@pytest.mark.parametrize("R,V,chunk", [(3, 7, None), (65, 300, None), (17, 5000, None), (33, 300, 64), (9, 1000, 128)])
def test_race_sample(kdev, R, V, chunk):
    check_race_sample(kdev, R=R, V=V, chunk=chunk)
