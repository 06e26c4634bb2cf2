"""The synthetic server's response-length distribution."""

from __future__ import annotations

import random
import statistics

import pytest

from verl_async_rm.testing import LengthDistribution

pytestmark = pytest.mark.unit


def test_heavy_tailed_and_clipped_to_budget():
    dist = LengthDistribution(median_tokens=32, sigma=1.0)
    rng = random.Random(0)
    draws = [dist.sample(rng, budget=4096) for _ in range(5000)]
    assert 24 <= statistics.median(draws) <= 40
    assert max(draws) > 8 * statistics.median(draws)  # a long tail, unlike a normal distribution
    assert all(1 <= n <= 4096 for n in draws)
    assert all(n <= 50 for n in (dist.sample(rng, budget=50) for _ in range(500)))
    capped = LengthDistribution(median_tokens=32, sigma=1.0, min_tokens=5, max_tokens=40)
    assert all(5 <= capped.sample(rng, budget=100) <= 40 for _ in range(500))


@pytest.mark.parametrize(
    "kwargs, field",
    [({"median_tokens": 0}, "median_tokens"), ({"sigma": -1}, "sigma"), ({"min_tokens": 0}, "min_tokens"),
     ({"min_tokens": 5, "max_tokens": 4}, "max_tokens")],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LengthDistribution(**kwargs)
