"""Failures: a raising batch_fn, wrong-length or malformed answers, per-item exceptions, batch timeouts, crashes of
the batching loop, and shutdown. After each, the batcher keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from verl_async_rm.errors import (
    AsyncRMError,
    BatchResultError,
    BatcherClosedError,
    BatcherCrashedError,
    RequestTimeoutError,
    RewardModelError,
)
from verl_async_rm.service.batcher import Batcher
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.service.batcher_stats import BatcherStats
from verl_async_rm.testing.batcher import GatedBatchFn, run_virtual

pytestmark = pytest.mark.unit

HOUR_MS = 3_600_000.0


class Poison(ValueError):
    pass


def spawn(batcher, items, **kwargs):
    return [asyncio.ensure_future(batcher.submit(item, **kwargs)) for item in items]


async def outcomes(tasks):
    """Each task's result, or its exception."""
    done = await asyncio.gather(*tasks, return_exceptions=True)
    return list(done)


async def still_serves(batcher, fn):
    fn.open()
    assert await asyncio.gather(*spawn(batcher, ["again"])) == ["again"]


def test_raising_batch_fails_every_caller_and_the_batcher_keeps_serving():
    async def main():
        boom = RuntimeError("rm forward failed")
        fn = GatedBatchFn(open=True, raise_if=lambda items: boom if "bad" in items else None)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=4))
        results = await outcomes(spawn(batcher, ["a", "bad", "c", "d"]))
        assert results == [boom] * 4
        await still_serves(batcher, fn)
        stats = batcher.stats()
        await batcher.aclose()
        return stats

    stats = run_virtual(main)
    assert stats["failed"] == 4 and stats["completed"] == 1


@pytest.mark.parametrize("answer", [lambda items: items[:-1], lambda items: items + ["extra"],
                                    lambda items: None, lambda items: {"a": 1}])
def test_malformed_answer_fails_the_batch_with_a_clear_error(answer):
    async def main():
        class Bad(GatedBatchFn):
            broken = True

            async def __call__(self, items, replica, deadline):
                out = await super().__call__(items, replica, deadline)
                if self.broken:
                    self.broken = False
                    return answer(items)
                return out

        fn = Bad(open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=3))
        results = await outcomes(spawn(batcher, ["a", "b", "c"]))
        assert all(isinstance(r, BatchResultError) for r in results)
        assert "one entry per item" in str(results[0]) and "batch of 3" in str(results[0])
        assert len(fn.calls) == 1  # one call: the batch failed as a whole
        await still_serves(batcher, fn)
        await batcher.aclose()

    run_virtual(main)


def test_a_blocking_batch_fn_is_reported():
    async def main():
        def sync_fn(items, replica, deadline):
            return items

        batcher = Batcher(sync_fn)
        with pytest.raises(BatchResultError, match="async"):
            await batcher.submit("x")
        await batcher.aclose()

    run_virtual(main)


def test_per_item_exceptions_reach_only_their_callers():
    async def main():
        fn = GatedBatchFn(lambda x: Poison(f"cannot score {x}") if x % 3 == 0 else x * 10, open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=6, max_wait_ms=1))
        results = await outcomes(spawn(batcher, range(6)))
        stats = batcher.stats()
        await batcher.aclose()
        return results, stats, fn.batch_sizes

    results, stats, sizes = run_virtual(main)
    assert sizes == [6]
    for i, r in enumerate(results):
        if i % 3 == 0:
            assert isinstance(r, Poison) and str(i) in str(r)
        else:
            assert r == i * 10
    assert stats["failed"] == 2 and stats["completed"] == 4


def test_batch_timeout_frees_the_replica_and_fails_the_batch():
    async def main():
        hang = asyncio.Event()

        async def batch_fn(items, replica, deadline):
            if "hang" in items:
                await hang.wait()  # never set
            return items

        batcher = Batcher(batch_fn, BatchPolicy(max_batch_size=2, max_wait_ms=1,
                                                                batch_timeout_s=5.0))
        stuck = await outcomes(spawn(batcher, ["hang", "x"]))
        assert all(isinstance(r, RequestTimeoutError) and "batch_timeout_s" in str(r) for r in stuck)
        assert await batcher.submit("fine") == "fine"
        stats = batcher.stats()
        await batcher.aclose()
        return stats

    stats = run_virtual(main)
    assert stats["timed_out"] == 2 and stats["completed"] == 1


def test_a_crash_of_the_loop_fails_pending_requests_with_the_cause_and_the_loop_restarts():
    async def main():
        fn = GatedBatchFn(open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=4, max_wait_ms=10))
        real = batcher._queue.departure
        bug = KeyError("bug in the loop")
        crashes = []

        def flaky(now):
            if not crashes:
                crashes.append(now)
                raise bug
            return real(now)

        batcher._queue.departure = flaky
        results = await outcomes(spawn(batcher, ["a", "b"]))
        assert all(isinstance(r, BatcherCrashedError) and r.__cause__ is bug for r in results)
        assert await asyncio.gather(*spawn(batcher, ["c", "d"])) == ["c", "d"]
        stats = batcher.stats()
        await batcher.aclose()
        return stats

    stats = run_virtual(main)
    assert stats["loop_restarts"] == 1 and stats["loop_alive"] is True
    assert stats["failed"] == 2 and stats["completed"] == 2


def test_a_crash_while_dispatching_strands_nobody(monkeypatch):
    async def main():
        fn = GatedBatchFn(open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=3, max_wait_ms=10))
        real = BatcherStats.record_batch
        calls = []

        def flaky(self, *args):
            calls.append(args)
            if len(calls) == 1:
                raise MemoryError("while recording")  # after the requests left the queue
            return real(self, *args)

        monkeypatch.setattr(BatcherStats, "record_batch", flaky)
        first = await outcomes(spawn(batcher, ["a", "b", "c", "d"]))
        assert [type(r) for r in first[:3]] == [BatcherCrashedError] * 3
        assert isinstance(first[3], BatcherCrashedError)  # still waiting when the loop died
        assert await batcher.submit("e") == "e"
        stats = batcher.stats()
        await batcher.aclose()
        return fn.seen, stats

    seen, stats = run_virtual(main)
    assert seen == ["e"] and stats["queue_len"] == 0 and stats["replicas_free"] == 1


def test_if_the_loop_task_is_killed_waiting_requests_fail_and_the_next_submit_restarts_it():
    async def main():
        fn = GatedBatchFn(open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=4, max_wait_ms=HOUR_MS))
        tasks = spawn(batcher, ["a", "b"])
        await asyncio.sleep(0)
        batcher._task.cancel()
        results = await outcomes(tasks)
        assert all(isinstance(r, BatcherCrashedError) for r in results)
        assert batcher.stats()["loop_alive"] is False
        later = spawn(batcher, ["c"])
        await asyncio.sleep(0)
        batcher.flush()
        assert await later[0] == "c"
        await batcher.aclose()

    run_virtual(main)


def test_aclose_fails_waiting_requests_and_lets_running_batches_finish():
    async def main():
        fn = GatedBatchFn()
        batcher = Batcher(fn, BatchPolicy(max_batch_size=2, max_wait_ms=HOUR_MS))
        running = spawn(batcher, ["r1", "r2"])
        await fn.wait_calls(1)
        waiting = spawn(batcher, ["w1", "w2", "w3"])
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(batcher.aclose(grace_s=60))
        await asyncio.sleep(0)
        results = await outcomes(waiting)
        assert all(isinstance(r, BatcherClosedError) for r in results)
        assert not closing.done()  # waiting for the running batch
        fn.open()
        assert await asyncio.gather(*running) == ["r1", "r2"]
        await closing
        with pytest.raises(BatcherClosedError):
            await batcher.submit("after")
        await batcher.aclose()  # idempotent
        return batcher.stats()

    stats = run_virtual(main)
    assert stats["completed"] == 2 and stats["failed"] == 3 and stats["rejected"] == 1 and stats["closed"]


def test_aclose_cancels_batches_that_outlive_the_grace_period():
    async def main():
        fn = GatedBatchFn()  # never opened
        batcher = Batcher(fn, BatchPolicy(max_batch_size=2, max_wait_ms=1))
        running = spawn(batcher, ["r1", "r2"])
        await fn.wait_calls(1)
        await batcher.aclose(grace_s=2.0)
        results = await outcomes(running)
        assert all(isinstance(r, BatcherClosedError) and isinstance(r, AsyncRMError) for r in results)
        assert batcher.stats()["in_flight_batches"] == 0

    run_virtual(main)


def test_aclose_does_not_hang_on_a_batch_fn_that_ignores_cancellation():
    async def main():
        async def stubborn(items, replica, deadline):
            while True:
                try:
                    await asyncio.sleep(1000)
                except asyncio.CancelledError:
                    continue

        batcher = Batcher(stubborn, BatchPolicy(max_batch_size=1, max_wait_ms=0))
        running = spawn(batcher, ["x"])
        await asyncio.sleep(0.5)
        await batcher.aclose(grace_s=1.0)
        assert isinstance((await outcomes(running))[0], BatcherClosedError)

    run_virtual(main, timeout_s=100.0)


@pytest.mark.parametrize("batch_timeout_s", [None, 5.0])
def test_a_batch_fn_that_raises_cancelled_error_by_itself_fails_its_batch_not_the_batcher(batch_timeout_s):
    async def main():
        async def cancels_itself(items, replica, deadline):
            if "x" in items:
                raise asyncio.CancelledError()
            return items

        policy = BatchPolicy(max_batch_size=2, max_wait_ms=1, batch_timeout_s=batch_timeout_s)
        batcher = Batcher(cancels_itself, policy)
        results = await outcomes(spawn(batcher, ["x", "y"]))
        assert all(isinstance(r, BatchResultError) and "CancelledError" in str(r) for r in results)
        assert await batcher.submit("z") == "z"
        await batcher.aclose()

    run_virtual(main)


def test_aclose_also_stops_a_call_running_under_batch_timeout():
    async def main():
        stopped = asyncio.Event()

        async def long_call(items, replica, deadline):
            try:
                await asyncio.sleep(100)
            finally:
                stopped.set()
            return items

        batcher = Batcher(long_call, BatchPolicy(max_batch_size=1, max_wait_ms=0,
                                                                 batch_timeout_s=50.0))
        running = spawn(batcher, ["a"])
        await asyncio.sleep(1)
        await batcher.aclose(grace_s=0)
        assert isinstance((await outcomes(running))[0], BatcherClosedError)
        await asyncio.sleep(0)
        assert stopped.is_set()

    run_virtual(main)


def test_async_with_closes_the_batcher():
    async def main():
        fn = GatedBatchFn(open=True)
        async with Batcher(fn, BatchPolicy(max_batch_size=2, max_wait_ms=1)) as batcher:
            assert await batcher.submit(1) == 1
        assert batcher.stats()["closed"]
        with pytest.raises(BatcherClosedError):
            await batcher.submit(2)

    run_virtual(main)


@pytest.mark.parametrize(
    "error", [RewardModelError("replica failed on the batch"), RequestTimeoutError("no answer in time")]
)
def test_a_failed_replica_or_timeout_fails_the_batch_in_one_call(error):
    calls = []

    async def batch_fn(items, replica, deadline):
        calls.append(len(items))
        raise error

    async def main():
        batcher = Batcher(batch_fn, BatchPolicy(max_batch_size=8, max_wait_ms=0))
        batcher.flush_after(8)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(8)), return_exceptions=True)
        await batcher.aclose()
        return results

    results = run_virtual(main)
    assert calls == [8]  # one call, no halves
    assert all(r is error for r in results)


def test_a_timed_out_call_that_ignores_cancellation_keeps_its_replica_late_and_aclose_still_returns():
    async def main():
        async def stubborn_on_r0(items, replica, deadline):
            while replica == "r0":
                try:
                    await asyncio.sleep(1000)
                except asyncio.CancelledError:
                    continue
            return items

        policy = BatchPolicy(max_batch_size=1, max_wait_ms=0, batch_timeout_s=5.0)
        batcher = Batcher(stubborn_on_r0, policy, replicas=["r0", "r1"])
        first = await outcomes(spawn(batcher, ["a"]))
        later = await asyncio.gather(*spawn(batcher, ["b", "c", "d"]))  # all on r1: r0 never ended its call
        stats = batcher.stats()
        await batcher.aclose(grace_s=1.0)
        return first, later, stats

    first, later, stats = run_virtual(main, timeout_s=100.0)
    assert isinstance(first[0], RequestTimeoutError) and later == ["b", "c", "d"]
    assert stats["replicas_timed_out"] == 1 and stats["in_flight_batches"] == 1 and stats["in_flight_requests"] == 0


@pytest.mark.parametrize("kind", [RequestTimeoutError, RewardModelError, BatcherCrashedError])
def test_an_error_pickles_with_its_type_cause_and_notes(kind):
    """What crosses the Ray boundary (replica -> service -> worker) is the error as it was made, cause included
    (Python's own pickling drops ``__cause__``); a cause that cannot pickle stays behind instead of failing."""
    import pickle

    err = kind("no score")
    err.__cause__ = KeyError("the tokenizer's")
    err.add_note("RM 'main'")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is kind and back.args == ("no score",) and back.__notes__ == ["RM 'main'"]
    assert type(back.__cause__) is KeyError and back.__cause__.args == ("the tokenizer's",)
    err.__cause__ = RuntimeError(lambda: None)  # its argument cannot pickle
    assert pickle.loads(pickle.dumps(err)).__cause__ is None
