"""Per-step figures (``pop_step_stats``): what one rollout step did, exact on the virtual-time loop."""

from __future__ import annotations

import asyncio

import pytest

from verl_async_rm.service.batcher import Batcher

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.testing.batcher import GatedBatchFn, run_virtual

pytestmark = pytest.mark.unit


def test_step_figures_are_per_step_and_exact():
    exec_s = 0.5

    async def main():
        fn = GatedBatchFn(lambda x: x, open=True, delay_s=exec_s)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=4, max_wait_ms=100), replicas=2)
        batcher.flush_after(6)
        await asyncio.gather(*(batcher.submit(i) for i in range(6)))  # the 6th flushes: 3 + 3 over the 2 replicas
        await asyncio.sleep(1.0)  # idle time in the step lowers utilisation
        first = batcher.pop_step_stats()
        await asyncio.gather(*(batcher.submit(i) for i in range(3)))  # 3 wait 100 ms for age, then run
        second = batcher.pop_step_stats()
        await batcher.aclose()
        return first, second

    first, second = run_virtual(main)
    assert first.submitted == 6 and first.completed == 6 and first.batches == 2
    assert first.mean_batch_size == 3.0 and first.mean_fill == 0.75
    assert first.wait_ms.count == 6 and first.wait_ms.max == pytest.approx(0.0)
    assert first.exec_ms.mean == pytest.approx(exec_s * 1000)
    # two batches of 0.5 s on 2 replicas, in parallel, over a 1.5 s step
    assert first.elapsed_s == pytest.approx(1.5) and first.rm_utilization == pytest.approx(1.0 / 3.0)
    assert first.tail_s == pytest.approx(exec_s)  # last submit at 0, last result at 0.5

    assert second.submitted == 3 and second.batches == 1 and second.failed == 0
    assert second.wait_ms.p99 == pytest.approx(100.0)
    assert second.elapsed_s == pytest.approx(0.6)
    assert second.tail_s == pytest.approx(0.1 + exec_s)  # waited 100 ms for age, then ran
    assert second.rm_utilization == pytest.approx(0.5 / (2 * 0.6))


def test_step_counts_failures_and_an_empty_step():
    async def main():
        fn = GatedBatchFn(lambda x: ValueError("bad") if x == 1 else x, open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=2, max_wait_ms=0), replicas=1)
        empty = batcher.pop_step_stats()
        results = await asyncio.gather(*(batcher.submit(i) for i in range(2)), return_exceptions=True)
        step = batcher.pop_step_stats()
        await batcher.aclose()
        return empty, results, step

    empty, results, step = run_virtual(main)
    assert empty.submitted == 0 and empty.batches == 0 and empty.rm_utilization is None
    assert isinstance(results[1], ValueError) and results[0] == 0
    assert step.completed == 1 and step.failed == 1
