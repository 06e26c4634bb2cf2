"""The computed bound and the ``sync`` model of the overlap benchmark, on hand-worked cases and against real runs."""

from __future__ import annotations

import pytest

from verl_async_rm.bench.bound import compute_bound, sync_batches, sync_rm_s
from verl_async_rm.bench.overlap import batcher_policies, run_policies
from verl_async_rm.bench.workload import RMCostModel, Workload, WorkloadConfig, generate_workload

pytestmark = pytest.mark.unit


def _workload(finish, tokens):
    return Workload(finish_s=tuple(finish), prompt_tokens=tuple([0] * len(tokens)), response_tokens=tuple(tokens))


def test_last_finish_dominates():
    # last (index 3, 400 tokens) finishes at 10: 10 + (1 + 0.01 * 400) = 15
    # work: 0.01 * 1000 + 1 * ceil(4 / 2) = 12 over 2 replicas = 6
    # sync: batches [3, 2] (1 + 0.01 * 2 * 400 = 9) and [1, 0] (1 + 0.01 * 2 * 200 = 5) on two replicas: 9
    b = compute_bound(_workload([1, 2, 3, 10], [100, 200, 300, 400]), RMCostModel(1.0, 0.01), 2, 2)
    assert b.lone_latency_s == pytest.approx(5.0)
    assert b.last_finish_bound_s == pytest.approx(15.0)
    assert b.total_work_s == pytest.approx(12.0) and b.work_bound_s == pytest.approx(6.0)
    assert b.bound_s == pytest.approx(15.0)
    assert b.sync_rm_s == pytest.approx(9.0) and b.predicted_sync_step_s == pytest.approx(19.0)
    assert b.predicted_speedup == pytest.approx(19.0 / 15.0)


def test_total_work_dominates():
    # 8 x 1000 tokens, all done at 0.5; a = 0.5, b = 0.001, cap 4, one replica
    # lone: 0.5 + 1 = 1.5 -> 2.0; work: 8 + 0.5 * 2 = 9 -> bound 9; sync: two batches of 0.5 + 4 = 4.5 -> 9
    w = _workload([0.5] * 8, [1000] * 8)
    b = compute_bound(w, RMCostModel(0.5, 0.001), 1, 4)
    assert b.last_finish_bound_s == pytest.approx(2.0)
    assert b.bound_s == pytest.approx(9.0)
    assert b.sync_rm_s == pytest.approx(9.0)
    assert b.predicted_speedup == pytest.approx(9.5 / 2.0)
    b3 = compute_bound(w, RMCostModel(0.5, 0.001), 3, 4)
    assert b3.bound_s == pytest.approx(3.0) and b3.sync_rm_s == pytest.approx(4.5)


def test_sync_batches_sort_longest_first_and_cut_at_the_cap():
    assert sync_batches([5, 9, 1, 9, 3], 2) == [[1, 3], [0, 4], [2]]
    assert sync_batches([], 4) == []


def test_sync_rm_s_hands_each_batch_to_the_first_free_replica():
    # cap 1: batches [30], [20], [10]; replica 0 runs 30, replica 1 runs 20 then 10 -> makespan 30
    assert sync_rm_s([10, 20, 30], RMCostModel(0.0, 1.0), 2, 1) == pytest.approx(30.0)
    assert sync_rm_s([10, 20, 30], RMCostModel(0.0, 1.0), 1, 1) == pytest.approx(60.0)


@pytest.mark.parametrize("replicas, cap", [(0, 4), (2, 0), (True, 4)])
def test_bad_replicas_or_cap_raise(replicas, cap):
    with pytest.raises(ValueError):
        compute_bound(_workload([1.0], [10]), RMCostModel(), replicas, cap)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_policy_beats_the_bound_and_sync_runs_as_modelled(seed):
    """On the virtual clock: every policy's step is >= the bound, and the sync runner takes the modelled time."""
    w = generate_workload(WorkloadConfig(trajectories=96, seed=seed))
    cost = RMCostModel(a_s=0.05, b_s_per_token=2e-4)  # a heavy RM so that the work bound matters
    policies = batcher_policies(8, None)
    b = compute_bound(w, cost, 2, 8)
    results = run_policies(w, cost, replicas=2, policies=policies, clock="virtual", scale=1.0,
                           predicted_sync_step_s=b.predicted_sync_step_s)
    for name, metrics in results.items():
        assert metrics["step_s"] >= b.bound_s - 1e-9, name
        assert metrics["scored"] == 96
    assert results["sync"]["step_s"] == pytest.approx(b.predicted_sync_step_s, rel=1e-9)
    assert results["per-request"]["mean_batch_size"] == 1.0
