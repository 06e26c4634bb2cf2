"""``--rm tiny``: the line fit, and one quick calibration on the real tiny RM (no timing asserted)."""

from __future__ import annotations

import pytest

from verl_async_rm.bench.calibrate import calibrate_tiny_rm, fit_line

pytestmark = pytest.mark.unit


def test_fit_line_recovers_an_exact_line_and_scores_noise():
    a, b, r2 = fit_line([0, 10, 20, 40], [1.0, 1.5, 2.0, 3.0])
    assert (a, b, r2) == pytest.approx((1.0, 0.05, 1.0))
    a, b, r2 = fit_line([0, 1, 2, 3], [0.0, 1.0, 0.0, 1.0])
    assert b == pytest.approx(0.2) and r2 == pytest.approx(0.2)


def test_fit_line_needs_two_distinct_x():
    with pytest.raises(ValueError, match="two distinct"):
        fit_line([5, 5], [1.0, 2.0])


def test_calibration_times_the_real_tiny_rm(tiny_models):
    shapes = ((1, 16), (4, 64))
    cost, record = calibrate_tiny_rm(reps=1, cache_dir=str(tiny_models.root.parent), shapes=shapes)
    assert record["model_path"] == str(tiny_models.rm)
    assert [(s["batch_size"], s["tokens_per_row"], s["padded_tokens"]) for s in record["samples"]] == [
        (1, 16, 16), (4, 64, 256)]
    assert all(s["min_s"] > 0 for s in record["samples"])
    assert (cost.a_s, cost.b_s_per_token) == (record["a_s"], record["b_s_per_token"])
    assert cost.a_s >= 0 and cost.b_s_per_token >= 0 and "tiny RM fit" in cost.source


def test_calibration_rejects_a_single_size(tiny_models):
    with pytest.raises(ValueError, match="two or more padded sizes"):
        calibrate_tiny_rm(reps=1, cache_dir=str(tiny_models.root.parent), shapes=((2, 8), (1, 16)))
