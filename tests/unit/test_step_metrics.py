"""The per-step ``async_rm/*`` figures: the RM service's step figures (``service_step_metrics``, from the batcher's
step stats and the replicas' counters) turned into metrics by ``service.metrics.step_metrics``.

The batcher figures come from a real ``Batcher`` step on the virtual-time loop, so the test follows
the StepStats the batcher really returns.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from verl_async_rm.service.batcher import Batcher

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.testing.batcher import GatedBatchFn, run_virtual
from verl_async_rm.service import metrics
from verl_async_rm.service.metrics import PREFIX, service_step_metrics

pytestmark = pytest.mark.unit


def step_metrics(batcher_step, replicas=(), trajectories=None, prefix=PREFIX):
    """What a manager logs for one step: the service's figures, then the integration's prefix and trajectory counts."""
    return metrics.step_metrics(service_step_metrics(batcher_step, replicas), trajectories, prefix=prefix)

ALL_KEYS = {
    "requests", "batches", "mean_batch_size", "mean_fill", "queue_wait_ms/mean", "queue_wait_ms/p99",
    "rm_exec_ms/mean", "rm_exec_ms/p99", "rm_utilization", "errors", "scored", "reward_tail_s", "requeued",
    "replicas_usable", "replicas_replaced_total",
}


def batcher_step(n: int, *, fail: frozenset = frozenset(), exec_s: float = 0.5, max_batch_size: int = 4):
    """One real batcher step: ``n`` requests (those in ``fail`` raise), then ``pop_step_stats()``."""

    async def main():
        fn = GatedBatchFn(lambda x: ValueError("bad") if x in fail else x, open=True, delay_s=exec_s)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=max_batch_size, max_wait_ms=10), replicas=2)
        batcher.pop_step_stats()  # start the step
        if n:
            batcher.flush_after(n)
            await asyncio.gather(*(batcher.submit(i) for i in range(n)), return_exceptions=True)
        step = batcher.pop_step_stats()
        await batcher.aclose()
        return step

    return run_virtual(main)


def test_a_full_step_has_every_key_as_a_float():
    step = batcher_step(6)
    metrics = step_metrics(step)
    assert set(metrics) == {PREFIX + key for key in ALL_KEYS}
    assert all(type(value) is float for value in metrics.values())
    assert metrics["async_rm/requests"] == 6.0 and metrics["async_rm/scored"] == 6.0
    assert metrics["async_rm/batches"] == step.batches == 2.0
    assert metrics["async_rm/mean_batch_size"] == 3.0 and metrics["async_rm/mean_fill"] == 0.75
    assert metrics["async_rm/rm_exec_ms/mean"] == pytest.approx(500.0)
    assert metrics["async_rm/queue_wait_ms/p99"] == pytest.approx(step.wait_ms.p99)
    assert metrics["async_rm/rm_utilization"] == pytest.approx(step.rm_utilization)
    assert metrics["async_rm/errors"] == 0.0
    assert metrics["async_rm/replicas_usable"] == 2.0 and metrics["async_rm/requeued"] == 0.0


def test_reward_tail_is_last_result_minus_last_submit_on_the_batcher_clock():
    # all 6 arrive at t=0; the 6th triggers the flush: two batches of 3 run 0.5 s in parallel
    metrics = step_metrics(batcher_step(6, exec_s=0.5))
    assert metrics["async_rm/reward_tail_s"] == pytest.approx(0.5)
    # a failing request still ends the tail: the last caller got its answer (an error) at 0.5 s too
    failing = step_metrics(batcher_step(6, fail=frozenset({5}), exec_s=0.5))
    assert failing["async_rm/reward_tail_s"] == pytest.approx(0.5) and failing["async_rm/errors"] == 1.0


def test_errors_count_failed_and_timed_out_requests():
    step = batcher_step(4, fail=frozenset({1, 3}), max_batch_size=1)
    assert step.failed == 2
    metrics = step_metrics(dataclasses.replace(step, timed_out=3))
    assert metrics["async_rm/errors"] == 5.0
    assert metrics["async_rm/requests"] == 4.0 and metrics["async_rm/scored"] == 2.0


def test_an_empty_step_leaves_out_figures_that_have_no_value():
    step = batcher_step(0)
    assert step.mean_batch_size is None and step.wait_ms.mean is None  # what the batcher reports
    assert step.tail_s is None
    assert step_metrics(step) == {
        "async_rm/requests": 0.0,
        "async_rm/batches": 0.0,
        "async_rm/errors": 0.0,
        "async_rm/scored": 0.0,
        "async_rm/requeued": 0.0,
        "async_rm/replicas_usable": 2.0,
        "async_rm/replicas_replaced_total": 0.0,
    }


def test_replica_counters_are_summed():
    from verl_async_rm.scoring.scorer import ScorerStats

    replicas = [ScorerStats(requests=4, failed=1, truncated=2), ScorerStats(requests=2, failed=0, truncated=1)]
    metrics = step_metrics(batcher_step(6), replicas)
    assert metrics["async_rm/truncated"] == 3.0 and metrics["async_rm/rm_failed_items"] == 1.0
    assert "async_rm/truncated" not in step_metrics(batcher_step(6))  # no replica figures given
