"""The overlap benchmark's workload generator and RM cost model (no clock, no Ray)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from verl_async_rm.bench.workload import RMCostModel, WorkloadConfig, generate_workload
from verl_async_rm.testing.generation import LengthDistribution

pytestmark = pytest.mark.unit


def test_same_config_gives_the_same_workload_and_another_seed_another():
    a = generate_workload(WorkloadConfig(trajectories=200, seed=7))
    b = generate_workload(WorkloadConfig(trajectories=200, seed=7))
    c = generate_workload(WorkloadConfig(trajectories=200, seed=8))
    assert a == b
    assert a.finish_s != c.finish_s and a.response_tokens != c.response_tokens


def test_shape_and_bounds_of_the_default_workload():
    config = WorkloadConfig()
    w = generate_workload(config)
    assert w.size == len(w.prompt_tokens) == len(w.response_tokens) == 1024
    assert all(16 <= p <= 2048 for p in w.prompt_tokens)
    assert all(1 <= r <= 4096 for r in w.response_tokens)
    assert w.tokens == tuple(p + r for p, r in zip(w.prompt_tokens, w.response_tokens))
    assert all(f >= config.prefill_s for f in w.finish_s)
    assert w.rollout_s == max(w.finish_s) == w.finish_s[w.last]
    s = w.summary()
    assert s["trajectories"] == 1024 and s["tokens_total"] == sum(w.tokens)
    # heavy tail: the slowest trajectories take many times the median, and some hit the response cap
    assert s["rollout_s"] > 5 * s["finish_s_p50"]
    assert 0 < sum(r == 4096 for r in w.response_tokens) < 0.1 * w.size


def test_finish_time_is_prefill_plus_decode_without_jitter():
    config = WorkloadConfig(trajectories=50, seed=3, prefill_s=0.5, decode_s_per_token=0.01, speed_sigma=0.0)
    w = generate_workload(config)
    for f, r in zip(w.finish_s, w.response_tokens):
        assert f == pytest.approx(0.5 + 0.01 * r)


def test_jitter_spreads_equal_lengths():
    fixed = LengthDistribution(median_tokens=100, sigma=0.0)
    w = generate_workload(WorkloadConfig(trajectories=20, response_lengths=fixed, speed_sigma=0.2))
    assert set(w.response_tokens) == {100}
    assert len(set(w.finish_s)) == 20
    flat = generate_workload(dataclasses.replace(WorkloadConfig(trajectories=20, response_lengths=fixed),
                                                 speed_sigma=0.0))
    assert len(set(flat.finish_s)) == 1


def test_last_picks_the_lowest_index_on_a_tie():
    fixed = LengthDistribution(median_tokens=10, sigma=0.0)
    w = generate_workload(WorkloadConfig(trajectories=5, response_lengths=fixed, speed_sigma=0.0))
    assert w.last == 0


@pytest.mark.parametrize("kwargs", [{"trajectories": 0}, {"trajectories": True}, {"decode_s_per_token": -1.0},
                                    {"prefill_s": math.inf}, {"speed_sigma": math.nan}])
def test_bad_workload_config_raises(kwargs):
    with pytest.raises(ValueError, match="WorkloadConfig"):
        WorkloadConfig(**kwargs)


def test_cost_model_charges_padding():
    cost = RMCostModel(a_s=0.5, b_s_per_token=0.01)
    assert cost.padded_tokens([10, 20, 5]) == 60
    assert cost.batch_s([10, 20, 5]) == pytest.approx(0.5 + 0.01 * 60)
    assert cost.batch_s([20]) == cost.lone_s(20) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="at least one item"):
        cost.batch_s([])


@pytest.mark.parametrize("kwargs", [{"a_s": -1.0}, {"b_s_per_token": math.nan}, {"a_s": 0.0, "b_s_per_token": 0.0}])
def test_bad_cost_model_raises(kwargs):
    with pytest.raises(ValueError, match="RMCostModel"):
        RMCostModel(**kwargs)
