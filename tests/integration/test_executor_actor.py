"""The executor as a Ray async actor, called by many callers at once (the driver and worker actors), with RM-replica
slots that are Ray actors themselves, as in the real deployment."""

from __future__ import annotations

import asyncio
import sys

import pytest

from verl_async_rm.errors import ExecutorClosedError, QueueFullError, RequestTimeoutError
from verl_async_rm.executor import BatchPolicy, create_executor_actor, submit_with_timeout

pytestmark = pytest.mark.integration

CALL_TIMEOUT_S = 60.0


class Unscorable(ValueError):
    """Returned by the fake replica for one item."""


class FakeReplica:
    """Stands in for an RM replica actor: ``score(items)`` returns one score (or exception) per item."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.batches: list[int] = []

    async def score(self, items: list) -> list:
        self.batches.append(len(items))
        await asyncio.sleep(0.01)  # a forward pass
        return [Unscorable(f"item {x}") if x == "bad" else (self.name, x * 2) for x in items]

    async def batch_sizes(self) -> list[int]:
        return list(self.batches)


class ReplicaBatchFn:
    """The executor's batch function: a picklable object that awaits the replica handle given as the slot."""

    async def __call__(self, items: list, slot) -> list:
        return await slot.score.remote(items)


class Caller:
    """An agent-loop worker stand-in: many concurrent trajectories, each submitting one request."""

    def __init__(self, executor) -> None:
        self.executor = executor

    async def run(self, start: int, count: int) -> list:
        async def one(i: int):
            return await submit_with_timeout(self.executor, i, timeout_s=CALL_TIMEOUT_S)

        return await asyncio.gather(*(one(i) for i in range(start, start + count)))


@pytest.fixture
def remote_classes(ray_local):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    try:
        yield ray_local
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.mark.asyncio
async def test_many_callers_share_one_executor_actor(remote_classes):
    ray = remote_classes
    replicas = [ray.remote(FakeReplica).options(num_cpus=0).remote(f"r{k}") for k in range(2)]
    policy = BatchPolicy(max_batch_size=16, max_wait_ms=20, max_pending=5000)
    executor = create_executor_actor(ReplicaBatchFn(), policy, replicas, name="test-executor",
                                     namespace="verl_async_rm_tests")
    assert await asyncio.wait_for(executor.ping.remote(), CALL_TIMEOUT_S)
    same = ray.get_actor("test-executor", namespace="verl_async_rm_tests")

    callers = [ray.remote(Caller).options(num_cpus=0).remote(same) for _ in range(2)]
    remote_runs = [c.run.remote(10_000 * (k + 1), 250) for k, c in enumerate(callers)]
    local = [submit_with_timeout(executor, i, timeout_s=CALL_TIMEOUT_S) for i in range(1000)]
    results = await asyncio.wait_for(asyncio.gather(*local, *remote_runs), CALL_TIMEOUT_S * 2)
    local_results, remote_results = results[:1000], results[1000:]
    assert [x for _, x in local_results] == [2 * i for i in range(1000)]
    for k, batch in enumerate(remote_results):
        assert [x for _, x in batch] == [2 * i for i in range(10_000 * (k + 1), 10_000 * (k + 1) + 250)]
    assert {name for name, _ in local_results} == {"r0", "r1"}  # both replicas served

    # per-item exceptions reach their caller as their own type; deadlines and backpressure are typed too
    with pytest.raises(Unscorable):
        await submit_with_timeout(executor, "bad", timeout_s=CALL_TIMEOUT_S)

    stats = await asyncio.wait_for(executor.stats.remote(), CALL_TIMEOUT_S)
    assert stats["completed"] == 1500 and stats["failed"] == 1 and stats["queue_len"] == 0
    assert stats["batch_size"]["max"] <= 16 and stats["batch_size"]["mean"] > 4  # requests were batched
    assert stats["policy"]["max_batch_size"] == 16
    sizes = sum(await asyncio.wait_for(asyncio.gather(*(r.batch_sizes.remote() for r in replicas)), CALL_TIMEOUT_S),
                [])
    assert sum(sizes) == 1501 and max(sizes) <= 16

    assert await asyncio.wait_for(executor.drain.remote(), CALL_TIMEOUT_S) == 0
    await asyncio.wait_for(executor.expect.remote(3), CALL_TIMEOUT_S)
    await asyncio.wait_for(executor.aclose.remote(), CALL_TIMEOUT_S)
    with pytest.raises(ExecutorClosedError):
        await submit_with_timeout(executor, 1, timeout_s=CALL_TIMEOUT_S)
    for handle in [executor, *callers, *replicas]:
        ray.kill(handle)


async def wait_stats(executor, predicate, tries: int = 600) -> dict:
    """Poll the actor's stats until ``predicate`` holds (bounded: fails after ``tries`` polls)."""
    for _ in range(tries):
        stats = await asyncio.wait_for(executor.stats.remote(), CALL_TIMEOUT_S)
        if predicate(stats):
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition never held; last stats: {stats}")


class SlowBatchFn:
    async def __call__(self, items: list, slot) -> list:
        await asyncio.sleep(30)
        return items


@pytest.mark.asyncio
async def test_actor_deadlines_backpressure_and_cancellation(remote_classes):
    ray = remote_classes
    policy = {"max_batch_size": 1, "max_wait_ms": 0, "max_pending": 2, "overflow": "reject"}
    executor = create_executor_actor(SlowBatchFn(), policy, 1)
    busy = executor.submit.remote("busy")  # occupies the only slot for 30 s
    await wait_stats(executor, lambda st: st["in_flight_batches"] == 1)
    waiting = [executor.submit.remote(i) for i in range(2)]
    await wait_stats(executor, lambda st: st["queue_len"] == 2)
    with pytest.raises(QueueFullError):
        await asyncio.wait_for(executor.submit.remote("one too many"), CALL_TIMEOUT_S)
    for ref in waiting:  # a cancelled call leaves the actor's queue
        ray.cancel(ref)
    stats = await wait_stats(executor, lambda st: st["cancelled"] == 2)
    assert stats["queue_len"] == 0 and stats["rejected"] == 1
    for ref in waiting:
        with pytest.raises(ray.exceptions.TaskCancelledError):
            await asyncio.wait_for(ref, CALL_TIMEOUT_S)
    # the executor-side deadline fires while the slot is busy, and reaches the caller as the executor's own error
    with pytest.raises(RequestTimeoutError, match="missed its deadline"):
        await submit_with_timeout(executor, "late", timeout_s=0.5)
    await asyncio.wait_for(executor.aclose.remote(0.0), CALL_TIMEOUT_S)
    with pytest.raises(ExecutorClosedError):
        await asyncio.wait_for(busy, CALL_TIMEOUT_S)
    ray.kill(executor)
