"""Request lifecycle: cancellation (before and during execution), deadlines (waiting, blocked, running, while every
replica is busy), max_pending backpressure (reject and block), and the statistics that account for all of it."""

from __future__ import annotations

import asyncio
import math

import pytest

from verl_async_rm.errors import BatcherClosedError, RequestTimeoutError
from verl_async_rm.service.batcher_stats import FLUSH_REASONS
from verl_async_rm.service.batcher import Batcher
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.testing.batcher import GatedBatchFn, run_virtual

pytestmark = pytest.mark.unit

HOUR_MS = 3_600_000.0


def spawn(batcher, items, **kwargs):
    return [asyncio.ensure_future(batcher.submit(item, **kwargs)) for item in items]


async def yield_all() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_cancel_before_dispatch_never_reaches_batch_fn():
    """Real event loop."""
    fn = GatedBatchFn(open=True)
    batcher = Batcher(fn, BatchPolicy(max_batch_size=8, max_wait_ms=HOUR_MS))
    tasks = spawn(batcher, range(5))
    await yield_all()
    tasks[1].cancel()
    tasks[3].cancel()
    await yield_all()
    assert batcher.stats()["queue_len"] == 3
    batcher.flush()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    assert [r for r in results if not isinstance(r, asyncio.CancelledError)] == [0, 2, 4]
    assert fn.seen == [0, 2, 4]
    stats = batcher.stats()
    assert stats["cancelled"] == 2 and stats["completed"] == 3
    await batcher.aclose()


def test_cancel_racing_with_the_flush_still_never_executes():
    """The flush is already scheduled when the caller is cancelled: the loop runs first and must skip it."""

    async def main():
        fn = GatedBatchFn(open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=4, max_wait_ms=HOUR_MS))
        tasks = spawn(batcher, range(3))
        await yield_all()
        last = asyncio.ensure_future(batcher.submit(3))  # reaching the cap wakes the loop...
        await asyncio.sleep(0)  # ...whose wake-up is now queued ahead of the cancellation below
        tasks[0].cancel()
        results = await asyncio.gather(*tasks, last, return_exceptions=True)
        stats = batcher.stats()
        await batcher.aclose()
        return results, fn.seen, stats

    results, seen, stats = run_virtual(main)
    assert isinstance(results[0], asyncio.CancelledError) and results[1:] == [1, 2, 3]
    assert seen == [1, 2, 3] and stats["cancelled"] == 1 and stats["completed"] == 3


def test_cancel_during_execution_disturbs_nothing_else():
    async def main():
        fn = GatedBatchFn(lambda x: x * 2)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=4, max_wait_ms=HOUR_MS))
        tasks = spawn(batcher, range(4))
        await fn.wait_calls(1)
        tasks[2].cancel()
        await yield_all()
        fn.open()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert await batcher.submit(10) == 20  # still serving
        stats = batcher.stats()
        await batcher.aclose()
        return results, stats

    results, stats = run_virtual(main)
    assert results[:2] == [0, 2] and isinstance(results[2], asyncio.CancelledError) and results[3] == 6
    assert stats["cancelled"] == 1 and stats["completed"] == 4 and stats["failed"] == 0


def test_deadline_fires_on_time_while_every_replica_is_busy():
    async def main():
        loop = asyncio.get_running_loop()
        fn = GatedBatchFn()
        batcher = Batcher(fn, BatchPolicy(max_batch_size=1, max_wait_ms=0), replicas=2)
        busy = spawn(batcher, ["busy-a", "busy-b"])
        await fn.wait_calls(2)
        t0 = loop.time()
        with pytest.raises(RequestTimeoutError, match="waiting for a batch"):
            await batcher.submit("late", deadline_s=0.050)
        elapsed = loop.time() - t0
        fn.open()
        await asyncio.gather(*busy)
        stats = batcher.stats()
        await batcher.aclose()
        return elapsed, fn.seen, stats

    elapsed, seen, stats = run_virtual(main)
    assert elapsed == pytest.approx(0.050, abs=1e-9)
    assert "late" not in seen and stats["timed_out"] == 1 and stats["completed"] == 2


def test_deadline_during_execution_fails_only_that_caller_and_drops_its_late_result():
    async def main():
        fn = GatedBatchFn()
        batcher = Batcher(fn, BatchPolicy(max_batch_size=3, max_wait_ms=HOUR_MS))
        quick = asyncio.ensure_future(batcher.submit("quick", deadline_s=1.0))
        others = spawn(batcher, ["a", "b"])
        await fn.wait_calls(1)
        with pytest.raises(RequestTimeoutError, match="in a running batch"):
            await quick
        fn.open()
        assert await asyncio.gather(*others) == ["a", "b"]
        stats = batcher.stats()
        await batcher.aclose()
        return stats

    stats = run_virtual(main)
    assert stats["timed_out"] == 1 and stats["completed"] == 2 and stats["submitted"] == 3


def test_a_deadline_applies_and_none_or_inf_opts_out():
    async def main():
        fn = GatedBatchFn()
        batcher = Batcher(fn, BatchPolicy(max_batch_size=8, max_wait_ms=HOUR_MS))
        timed, forever = spawn(batcher, ["d"], deadline_s=2.0), spawn(batcher, ["f"], deadline_s=math.inf)
        untimed = spawn(batcher, ["n"])
        await asyncio.sleep(10.0)
        assert isinstance(timed[0].exception(), RequestTimeoutError)
        assert not forever[0].done() and not untimed[0].done()
        fn.open()
        batcher.flush()
        assert await forever[0] == "f" and await untimed[0] == "n"
        await batcher.aclose()

    run_virtual(main)


def test_a_deadline_already_passed_times_out_at_once_and_is_counted():
    """A caller's time left that ran out before it asked (0 or less) is a timeout like any, never a refusal."""
    async def main():
        fn = GatedBatchFn()
        batcher = Batcher(fn, BatchPolicy(max_batch_size=8, max_wait_ms=HOUR_MS))
        late = spawn(batcher, ["z", "m"], deadline_s=0.0) + spawn(batcher, ["n"], deadline_s=-0.25)
        await asyncio.sleep(0.01)
        assert all(isinstance(t.exception(), RequestTimeoutError) for t in late)
        stats = batcher.stats()
        assert stats["submitted"] == 3 and stats["timed_out"] == 3
        with pytest.raises(ValueError, match="deadline_s must be a number"):
            await batcher.submit("x", deadline_s=math.nan)
        await batcher.aclose()

    run_virtual(main)


def test_stats_account_for_every_request():
    async def main():
        fn = GatedBatchFn(lambda x: ValueError("bad") if x == "fail" else x, open=True, delay_s=0.01)
        policy = BatchPolicy(max_batch_size=4, max_wait_ms=5)
        batcher = Batcher(fn, policy, replicas=2)
        tasks = spawn(batcher, ["ok1", "ok2", "fail", "ok3", "slow"], num_tokens=7)
        tasks += spawn(batcher, ["timeout"], num_tokens=7, deadline_s=0.001)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        closing = asyncio.ensure_future(batcher.aclose())
        await asyncio.sleep(0)
        results += await asyncio.gather(batcher.submit("reject", num_tokens=7), return_exceptions=True)
        await closing
        return results, batcher.stats()

    results, stats = run_virtual(main)
    assert isinstance(results[-1], BatcherClosedError) and isinstance(results[-2], RequestTimeoutError)
    assert stats["submitted"] == 6 and stats["rejected"] == 1
    assert stats["completed"] + stats["failed"] + stats["timed_out"] + stats["cancelled"] == stats["submitted"]
    assert (stats["completed"], stats["failed"], stats["timed_out"]) == (4, 1, 1)
    assert set(stats["flush_reasons"]) == set(FLUSH_REASONS) and stats["batches"] >= 1
    assert stats["wait_ms"]["count"] == 5 and stats["exec_ms"]["p50"] == pytest.approx(10.0)
    assert stats["padding_fraction"] == 0.0 and stats["queue_len"] == 0 and stats["in_flight_batches"] == 0
    for key in ("batch_size", "wait_ms", "exec_ms"):
        assert {"mean", "p50", "p90", "p99", "max"} <= set(stats[key])
