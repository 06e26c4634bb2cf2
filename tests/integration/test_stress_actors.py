"""Stress through the real Ray actors: 10^4 requests from many concurrent callers into the executor actor, scored by
replica actors through the package's RMBatchFn, with random arrivals and sizes, per-item failures, cancellations and
replica kills (each killed replica is replaced by the executor). Every request must resolve exactly once.

The replicas are light stand-ins (an async actor answering ``score(items)`` with one float or one exception per item,
after a delay that grows with the batch's tokens): the thing under test is the executor actor, RMBatchFn, the
replacement path and ``submit_with_timeout``, not the RM's forward (tested elsewhere with the real RM).
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from collections import Counter

import pytest
import ray

from verl_async_rm.errors import NoSlotsError, RequestTimeoutError, SlotLostError
from verl_async_rm.executor import BatchPolicy, create_executor_actor, submit_with_timeout
from verl_async_rm.rm import RMBatchFn

pytestmark = pytest.mark.integration
logger = logging.getLogger(__name__)

N_REQUESTS = 10_000
N_REPLICAS = 4
FAIL_EVERY = 23  # items with id % 23 == 0 fail on the replica (about 4%)
CANCEL_FRACTION = 0.05
KILLS = 6
HANG_S = 300.0


class Unscorable(ValueError):
    """What a stand-in replica returns for an item it cannot score."""


class StandInReplica:
    """``score(items)``: ``2 * id + 0.5`` per item, or Unscorable for every FAIL_EVERY-th id; slower for more tokens."""

    def __init__(self, generation: int) -> None:
        self.generation = generation

    async def ping(self) -> int:
        return self.generation

    async def score(self, items: list) -> list:
        tokens = len(items) * max(size for _, size in items)
        await asyncio.sleep(0.002 + 2e-6 * tokens)
        return [Unscorable(f"item {i}") if i % FAIL_EVERY == 0 else 2.0 * i + 0.5 for i, _ in items]


class StandInFactory:
    """The executor's ``replace_slot``: a new stand-in replica for a killed one."""

    def __init__(self) -> None:
        self.made = 0

    async def __call__(self, old, index: int):
        self.made += 1
        replica = ray.remote(StandInReplica).options(num_cpus=0, max_restarts=0).remote(self.made)
        await asyncio.wait_for(replica.ping.remote(), 60)
        return replica


@pytest.fixture
def by_value(ray_local):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this test module
    try:
        yield ray_local
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_ten_thousand_requests_resolve_exactly_once_through_the_actors(by_value):
    rng = random.Random(1234)
    replicas = [ray.remote(StandInReplica).options(num_cpus=0, max_restarts=0).remote(0) for _ in range(N_REPLICAS)]
    executor = create_executor_actor(
        RMBatchFn(timeout_s=60.0), BatchPolicy(max_batch_size=32, max_batch_tokens=4096, max_wait_ms=5,
                                               slot_retries=3),
        replicas, replace_slot=StandInFactory(),
    )
    ray.get(executor.ping.remote(), timeout=60)
    sizes = [rng.choice([rng.randint(1, 64), rng.randint(64, 512), rng.randint(512, 5000)]) for _ in range(N_REQUESTS)]
    arrivals = [rng.expovariate(1.0 / 0.0015) for _ in range(N_REQUESTS)]  # ~650 requests/s for ~15 s
    cancel_at = {i: rng.uniform(0.0, 0.05) for i in rng.sample(range(N_REQUESTS), int(CANCEL_FRACTION * N_REQUESTS))}
    outcomes: dict[int, list] = {i: [] for i in range(N_REQUESTS)}

    async def one(i: int) -> None:
        try:
            value = await submit_with_timeout(executor, (i, sizes[i]), timeout_s=120.0, num_tokens=sizes[i])
            outcomes[i].append(("ok", value))
        except asyncio.CancelledError:
            outcomes[i].append(("cancelled", None))
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded and checked below
            outcomes[i].append(("error", exc))

    async def killer(stop: asyncio.Event) -> int:
        kills = 0
        while kills < KILLS and not stop.is_set():
            await asyncio.sleep(1.5)
            slots = await asyncio.wait_for(executor.slots.remote(), 30)
            ray.kill(rng.choice(slots), no_restart=True)
            kills += 1
        return kills

    async def main():
        stop = asyncio.Event()
        kill_task = asyncio.ensure_future(killer(stop))
        tasks = []
        for i in range(N_REQUESTS):
            await asyncio.sleep(arrivals[i])
            task = asyncio.ensure_future(one(i))
            tasks.append(task)
            if i in cancel_at:
                asyncio.get_running_loop().call_later(cancel_at[i], task.cancel)
        _, pending = await asyncio.wait(tasks, timeout=HANG_S)
        stop.set()
        kills = await kill_task
        stats = None
        for _ in range(100):  # cancelled calls settle in the executor a moment after the callers gave up
            stats = await asyncio.wait_for(executor.stats.remote(), 30)
            if stats["in_flight_requests"] == 0 and stats["queue_len"] == 0:
                break
            await asyncio.sleep(0.1)
        return len(pending), kills, stats

    t0 = time.monotonic()
    try:
        pending, kills, stats = asyncio.run(main())
    finally:
        ray.kill(executor)
    elapsed = time.monotonic() - t0

    assert pending == 0, "a caller never got an answer"
    assert all(len(v) == 1 for v in outcomes.values()), "a caller got more than one outcome"
    kinds: Counter = Counter()
    for i, [(kind, value)] in outcomes.items():
        if kind == "ok":
            assert i % FAIL_EVERY != 0 and value == 2.0 * i + 0.5, (i, value)
            kinds["scored"] += 1
        elif kind == "cancelled":
            assert i in cancel_at
            kinds["cancelled"] += 1
        elif isinstance(value, Unscorable):
            assert i % FAIL_EVERY == 0
            kinds["item_failed"] += 1
        else:  # a replica killed under the same request more than slot_retries times; nothing else is allowed
            assert isinstance(value, SlotLostError) and not isinstance(value, (NoSlotsError, RequestTimeoutError)), value
            kinds["slot_lost"] += 1
    # executor side: every request it accepted was settled exactly once (each settle bumps exactly one counter)
    settled = stats["completed"] + stats["failed"] + stats["timed_out"] + stats["cancelled"]
    assert stats["submitted"] == settled and stats["in_flight_requests"] == 0 and stats["queue_len"] == 0
    assert stats["submitted"] <= N_REQUESTS  # a caller cancelled before its submit reached the actor never counts
    assert kills == KILLS and stats["slots_lost_total"] >= 1 and stats["slots_replaced_total"] >= 1
    assert stats["slots_lost"] == 0  # every killed replica was replaced
    assert kinds["scored"] + kinds["item_failed"] + kinds["cancelled"] + kinds["slot_lost"] == N_REQUESTS
    logger.warning(
        "stress: %d requests in %.1f s: %s; executor: submitted %d, completed %d, failed %d, timed_out %d, "
        "cancelled %d, requeued %d, batches %d, replicas killed %d, lost %d, replaced %d",
        N_REQUESTS, elapsed, dict(kinds), stats["submitted"], stats["completed"], stats["failed"],
        stats["timed_out"], stats["cancelled"], stats["requeued"], stats["batches"], kills,
        stats["slots_lost_total"], stats["slots_replaced_total"],
    )
