"""The demo's figures, computed from per-step timeline records (pure code, no Ray)."""

from __future__ import annotations

import math

import pytest

from verl_async_rm.demo.timeline import MODE_KEYS, STEP_KEYS, BatchRecord, StepTimeline, mode_summary, speedup

pytestmark = pytest.mark.unit

T0 = 1_000.0


def step(mode="async", finishes=(1.0, 2.0, 4.0), batches=((0, 1.1, 1.5, 1), (1, 2.1, 2.6, 1), (0, 4.1, 4.5, 1)),
         t_end=4.6, replicas=2, rewards=(1.0, 2.0, 3.0)):
    return StepTimeline(
        mode=mode, step=1, t0=T0, t_end=T0 + t_end, finishes=[T0 + t for t in finishes],
        batches=[BatchRecord(replica=r, start=T0 + s, end=T0 + e, size=n) for r, s, e, n in batches],
        num_replicas=replicas, rewards=list(rewards), rm_scores=list(rewards), rule_scores=[0.5] * len(rewards),
    )


def test_step_figures_from_records():
    m = step().metrics()
    assert set(m) == set(STEP_KEYS)
    assert m["step_time_s"] == pytest.approx(4.6)
    assert m["rollout_s"] == pytest.approx(4.0)
    assert m["reward_tail_s"] == pytest.approx(0.5)  # last batch end 4.5 - last finish 4.0
    assert m["rm_utilization"] == pytest.approx((0.4 + 0.5 + 0.4) / (2 * 4.6))
    assert m["batches"] == 3 and m["mean_batch_size"] == pytest.approx(1.0)
    assert m["trajectories"] == 3 and m["scored"] == 3
    assert m["reward_mean"] == pytest.approx(2.0) and m["rule_score_mean"] == pytest.approx(0.5)


def test_sync_step_tail_is_the_whole_scoring_after_rollout():
    s = step(mode="sync", batches=((0, 4.1, 6.0, 2), (1, 4.1, 5.0, 1)), t_end=6.1)
    m = s.metrics()
    assert m["reward_tail_s"] == pytest.approx(2.0)
    assert m["mean_batch_size"] == pytest.approx(1.5) and m["scored"] == 3


def test_a_step_with_no_batches_has_no_tail_and_zero_utilization():
    m = step(batches=()).metrics()
    assert m["reward_tail_s"] is None and m["mean_batch_size"] is None
    assert m["rm_utilization"] == 0.0 and m["batches"] == 0 and m["scored"] == 0


def test_non_finite_rewards_are_left_out_of_means():
    assert step(rewards=(1.0, math.nan, 3.0)).metrics()["reward_mean"] == pytest.approx(2.0)


def test_to_dict_gives_times_relative_to_step_start_sorted():
    d = step(batches=((1, 2.1, 2.6, 1), (0, 1.1, 1.5, 2))).to_dict()
    assert d["timeline"]["finishes_s"] == pytest.approx([1.0, 2.0, 4.0])
    assert [(b["replica"], b["size"]) for b in d["timeline"]["batches"]] == [(0, 2), (1, 1)]
    assert d["timeline"]["batches"][0]["start_s"] == pytest.approx(1.1)
    assert d["timeline"]["end_s"] == pytest.approx(4.6) and d["timeline"]["t0_unix"] == T0
    assert set(STEP_KEYS) <= set(d)


def test_mode_summary_means_steps_and_weights_batch_size_by_batch():
    a = step()  # 3 batches of 1
    b = step(batches=((0, 4.1, 4.5, 3),), t_end=5.6)  # 1 batch of 3
    summary = mode_summary([a, b])
    assert set(summary) == set(MODE_KEYS)
    assert summary["steps"] == 2 and summary["batches"] == 4
    assert summary["step_time_s"] == pytest.approx((4.6 + 5.6) / 2)
    assert summary["mean_batch_size"] == pytest.approx(6 / 4)
    assert summary["reward_tail_s"] == pytest.approx(0.5)


def test_speedup_is_sync_over_async_step_time():
    assert speedup({"async": {"step_time_s": 5.0}, "sync": {"step_time_s": 8.0}}) == pytest.approx(1.6)
    assert speedup({"async": {"step_time_s": 5.0}}) is None
    assert speedup({"async": {"step_time_s": None}, "sync": {"step_time_s": 8.0}}) is None


def test_records_that_run_backwards_are_refused():
    with pytest.raises(ValueError, match="before start"):
        BatchRecord(replica=0, start=2.0, end=1.0, size=1)
    with pytest.raises(ValueError, match="before t0"):
        StepTimeline(mode="async", step=1, t0=2.0, t_end=1.0, finishes=[], batches=[], num_replicas=1)


def test_sampled_trajectories_are_put_back_in_prompt_order():
    """verl's replay buffer lists a step's trajectories as they finished; the demo reports them in prompt order."""
    from verl_async_rm.demo.modes import sampled_order

    uids = ["sync-step1-0", "sync-step1-1", "sync-step1-2"]
    keys = ["sync-step1-2_0_0", "sync-step1-0_1_0", "sync-step1-1_0_0", "sync-step1-0_0_0"]
    order = sampled_order(keys, uids)
    assert [keys[i] for i in order] == ["sync-step1-0_0_0", "sync-step1-0_1_0", "sync-step1-1_0_0", "sync-step1-2_0_0"]
    assert sampled_order(["b_0_0", "a_0_0"], ["a", "b"]) == [1, 0]


def test_a_sampled_batch_that_misses_a_prompt_or_holds_a_foreign_one_is_refused():
    from verl_async_rm.demo.modes import sampled_order

    with pytest.raises(RuntimeError, match="no sampled trajectory: \\['b'\\]"):
        sampled_order(["a_0_0"], ["a", "b"])
    with pytest.raises(RuntimeError, match="'c_0_0' belongs to no prompt"):
        sampled_order(["a_0_0", "c_0_0"], ["a"])
