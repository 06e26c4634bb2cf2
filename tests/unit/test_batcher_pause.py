"""``hold`` / ``resume`` (the RM asleep while the policy trains) and ``lose_replica`` (a replica found dead between
batches): on the virtual clock, so waits are exact and take no real time."""

from __future__ import annotations

import asyncio

import pytest

from verl_async_rm.service.batcher import Batcher

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.errors import RequestTimeoutError, ReplicaLostError
from verl_async_rm.testing.batcher import run_virtual

pytestmark = pytest.mark.unit


class Slow:
    """Each call takes ``delay_s`` (virtual) and answers ``item@replica``."""

    def __init__(self, delay_s: float = 1.0) -> None:
        self.delay_s = delay_s
        self.calls: list[tuple[float, list, object]] = []

    async def __call__(self, items, replica, deadline):
        self.calls.append((asyncio.get_running_loop().time(), list(items), replica))
        await asyncio.sleep(self.delay_s)
        return [f"{item}@{replica}" for item in items]


def test_held_requests_wait_for_resume_and_then_score_all():
    async def main():
        fn = Slow()
        ex = Batcher(fn, BatchPolicy(max_batch_size=8, max_wait_ms=10), replicas=2)
        loop = asyncio.get_running_loop()
        assert await ex.pause(timeout_s=5) is True and ex.paused
        tasks = [asyncio.ensure_future(ex.submit(i)) for i in range(3)]
        await asyncio.sleep(100)  # far past max_wait_ms: nothing starts while held
        assert fn.calls == [] and not any(t.done() for t in tasks)
        ex.resume()
        results = await asyncio.gather(*tasks)
        assert sorted(r.split("@")[0] for r in results) == ["0", "1", "2"]
        assert fn.calls[0][0] == pytest.approx(100.0, abs=0.02)  # flushed right after the resume
        assert loop.time() == pytest.approx(101.0, abs=0.02)
        await ex.aclose()

    run_virtual(main)


def test_hold_waits_for_the_running_batch_and_is_bounded():
    async def main():
        fn = Slow(delay_s=3.0)
        ex = Batcher(fn, BatchPolicy(max_batch_size=1, max_wait_ms=0), replicas=1)
        loop = asyncio.get_running_loop()
        running = asyncio.ensure_future(ex.submit("a"))
        await asyncio.sleep(0.5)
        assert len(fn.calls) == 1
        assert await ex.pause(timeout_s=1.0) is False  # the batch still runs after the bound
        assert loop.time() == pytest.approx(1.5)
        assert await ex.pause(timeout_s=10.0) is True  # it ends at t=3.0
        assert loop.time() == pytest.approx(3.0) and await running == "a@0"
        ex.resume()
        await ex.aclose()

    run_virtual(main)


def test_a_deadline_still_fails_a_request_held_too_long():
    async def main():
        fn = Slow()
        ex = Batcher(fn, BatchPolicy(max_batch_size=8, max_wait_ms=10), replicas=1)
        await ex.pause(timeout_s=1)
        task = asyncio.ensure_future(ex.submit("late", deadline_s=30.0))
        with pytest.raises(RequestTimeoutError, match="waiting for a batch"):
            await task
        ex.resume()
        assert await ex.submit("after") == "after@0"
        await ex.aclose()

    run_virtual(main)


def test_lose_replica_replaces_a_free_replica_and_ignores_a_busy_one():
    async def main():
        fn = Slow()
        made = []

        async def replace(old, index):
            await asyncio.sleep(2.0)
            made.append((old, index))
            return f"new{index}"

        ex = Batcher(fn, BatchPolicy(max_batch_size=1, max_wait_ms=0), replicas=["r0", "r1"],
                                    replace_replica=replace)
        busy = asyncio.ensure_future(ex.submit("x"))
        await asyncio.sleep(0.1)
        busy_index = ex.replicas.index(fn.calls[0][2])
        assert ex.lose_replica(busy_index, ReplicaLostError("gone")) is False  # a running batch will tell
        free_index = 1 - busy_index
        assert ex.lose_replica(free_index, ReplicaLostError("died asleep")) is True
        assert ex.stats()["replicas_replacing"] == 1
        await busy
        await asyncio.sleep(3.0)
        assert made == [(f"r{free_index}", free_index)] and ex.replicas[free_index] == f"new{free_index}"
        assert ex.stats()["replicas_free"] == 2
        await ex.aclose()

    run_virtual(main)
