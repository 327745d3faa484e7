"""race_sample under the interpreter: the fused sampling filters and race against the reference
(helpers/kernel_checks)."""

import pytest

from tests.helpers.kernel_checks import check_race_sample


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the NaN rows, as the GPU does silently
@pytest.mark.parametrize("R,V", [(3, 7), (65, 300), (17, 5000)])
def test_race_sample(kdev, R, V):
    check_race_sample(kdev, R=R, V=V)
