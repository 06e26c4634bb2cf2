"""Replicas that fail as a whole: a lost replica's requests go to the other replicas, the replica is replaced (or retired), a
late replica (its call ran past batch_timeout_s) gets no batch until the cancelled call has ended, and with no replica left
every waiter fails at once."""

from __future__ import annotations

import asyncio

import pytest

from verl_async_rm.errors import NoReplicasError, RequestTimeoutError, ReplicaLostError
from verl_async_rm.service.batcher import Batcher
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.testing.batcher import run_virtual

pytestmark = pytest.mark.unit

HOUR_MS = 3_600_000.0


class Replicas:
    """A batch function over named replicas; a replica in ``dead`` raises ReplicaLostError; a call on a replica in ``stuck``
    hangs, and once cancelled (``batch_timeout_s``) waits for ``stuck[replica]`` like the RM side waits for the remote call
    to come back: it then ends, or raises what that future holds (ReplicaLostError: the replica never answered)."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.delay_s = delay_s
        self.dead: set = set()
        self.stuck: dict = {}  # replica -> asyncio.Event that ends its hang
        self.calls: list[tuple[list, object]] = []

    async def __call__(self, items, replica, deadline):
        self.calls.append((list(items), replica))
        await asyncio.sleep(self.delay_s)
        if replica in self.stuck:
            release = asyncio.get_running_loop().create_future()
            self.stuck[replica] = release
            try:
                await asyncio.Event().wait()  # no answer
            except asyncio.CancelledError:
                await release
                raise
        if replica in self.dead:
            raise ReplicaLostError(f"{replica} died")
        return [f"{item}@{replica}" for item in items]

    def replicas_used(self) -> list:
        return [replica for _, replica in self.calls]


def spawn(batcher, items):
    return [asyncio.ensure_future(batcher.submit(item)) for item in items]


def test_requests_of_a_lost_replica_are_scored_on_the_other_replica_and_the_replica_is_retired():
    async def main():
        fn = Replicas()
        fn.dead.add("r0")
        batcher = Batcher(fn, BatchPolicy(max_batch_size=4, max_wait_ms=HOUR_MS), replicas=["r0", "r1"])
        results = await asyncio.gather(*spawn(batcher, list("abcdefgh")))
        stats = batcher.stats()
        assert await asyncio.gather(*spawn(batcher, ["i"])) == ["i@r1"]  # r0 is never used again
        await batcher.aclose()
        return fn, results, stats

    fn, results, stats = run_virtual(main)
    assert sorted(results) == [f"{c}@r1" for c in "abcdefgh"]
    assert fn.replicas_used().count("r0") == 1  # one failed call, then retired
    assert stats["requeued"] == 4 and stats["completed"] == 8 and stats["failed"] == 0
    assert stats["replicas_lost"] == 1 and stats["replicas_lost_total"] == 1 and stats["replicas_free"] == 1


def test_a_lost_replica_is_replaced_and_takes_batches_again():
    async def main():
        fn = Replicas()
        fn.dead.add("r0")
        replaced = []

        async def replace(replica, index):
            await asyncio.sleep(5.0)  # a replica takes a while to load
            replaced.append((replica, index))
            return "r0-new"

        batcher = Batcher(fn, BatchPolicy(max_batch_size=2, max_wait_ms=HOUR_MS), replicas=["r0"],
                                          replace_replica=replace)
        first = spawn(batcher, ["a", "b"])
        await asyncio.sleep(1.0)
        assert not any(t.done() for t in first)  # re-queued, waiting for the replacement instead of failing
        results = await asyncio.gather(*first)
        stats = batcher.stats()
        await batcher.aclose()
        return replaced, results, stats

    replaced, results, stats = run_virtual(main)
    assert replaced == [("r0", 0)]
    assert results == ["a@r0-new", "b@r0-new"]
    assert stats["replicas_replaced_total"] == 1 and stats["replicas_free"] == 1 and stats["requeued"] == 2


def test_requeues_are_bounded_then_the_request_fails_with_the_replica_error():
    async def main():
        fn = Replicas()
        fn.dead.update({"r0", "r1", "r2", "r3"})
        batcher = Batcher(fn, BatchPolicy(max_batch_size=1, max_wait_ms=0, replica_retries=2),
                                          replicas=["r0", "r1", "r2", "r3"])
        outcome = await asyncio.gather(batcher.submit("a"), return_exceptions=True)
        await batcher.aclose()
        return fn, outcome[0]

    fn, outcome = run_virtual(main)
    assert isinstance(outcome, ReplicaLostError)
    assert len(fn.calls) == 3  # the first try and two re-queues, each on another replica
    assert len(set(fn.replicas_used())) == 3


def test_with_no_replica_left_waiters_and_new_submits_fail_at_once():
    async def main():
        fn = Replicas()
        fn.dead.update({"r0", "r1"})

        async def cannot_replace(replica, index):
            raise RuntimeError("no resources for a new replica")

        batcher = Batcher(fn, BatchPolicy(max_batch_size=2, max_wait_ms=HOUR_MS, replica_retries=5),
                                          replicas=["r0", "r1"], replace_replica=cannot_replace)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        waiting = spawn(batcher, ["a", "b", "c", "d", "e"])
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        elapsed = loop.time() - t0
        with pytest.raises(NoReplicasError, match="all 2 replica"):
            await batcher.submit("late")
        stats = batcher.stats()
        await batcher.aclose()
        return outcomes, elapsed, stats

    outcomes, elapsed, stats = run_virtual(main)
    assert all(isinstance(o, NoReplicasError) for o in outcomes)
    assert elapsed < 1.0  # virtual seconds: nothing waited for max_wait_ms (an hour) or a deadline
    assert stats["replicas_lost"] == 2 and stats["replicas_replace_failed_total"] == 2


def test_a_late_replica_gets_no_batch_until_its_call_answers():
    async def main():
        fn = Replicas()
        fn.stuck["r0"] = None
        policy = BatchPolicy(max_batch_size=1, max_wait_ms=0, batch_timeout_s=5.0)
        batcher = Batcher(fn, policy, replicas=["r0", "r1"], name="rm")
        first = await asyncio.gather(batcher.submit("a"), return_exceptions=True)
        late_stats = batcher.stats()
        release = fn.stuck.pop("r0")
        during = await asyncio.gather(*spawn(batcher, ["b", "c"]))
        release.set_result(None)  # the replica finally answers its old call
        await asyncio.sleep(0.1)
        after_stats = batcher.stats()
        fn.delay_s = 0.0
        both = await asyncio.gather(*spawn(batcher, ["d", "e", "f", "g"]))
        await batcher.aclose()
        return first[0], late_stats, during, after_stats, both

    first, late_stats, during, after_stats, both = run_virtual(main)
    assert isinstance(first, RequestTimeoutError)
    for part in ("'rm'", "batch of 1", "replica 0 ('r0')", "batch_timeout_s=5"):
        assert part in str(first), (part, str(first))
    assert late_stats["replicas_timed_out"] == 1 and late_stats["replicas_timed_out_total"] == 1
    assert late_stats["timed_out"] == 1 and late_stats["in_flight_requests"] == 0
    assert all(r.endswith("@r1") for r in during)
    assert after_stats["replicas_timed_out"] == 0 and after_stats["replicas_free"] == 2
    assert {r.split("@")[1] for r in both} == {"r0", "r1"}


@pytest.mark.parametrize("replace", [False, True])
def test_a_late_call_that_ends_with_the_replica_dead_loses_the_replica(replace):
    async def main():
        fn = Replicas()
        fn.stuck["r0"] = None

        async def replace_replica(replica, index):
            return "r0-new"

        policy = BatchPolicy(max_batch_size=1, max_wait_ms=0, batch_timeout_s=5.0)
        batcher = Batcher(fn, policy, replicas=["r0", "r1"],
                                          replace_replica=replace_replica if replace else None)
        first = await asyncio.gather(batcher.submit("a"), return_exceptions=True)
        release = fn.stuck.pop("r0")
        release.set_exception(ReplicaLostError("r0 died while late"))
        await asyncio.sleep(0.1)
        stats = batcher.stats()
        await batcher.aclose()
        return first[0], stats, fn.calls

    first, stats, calls = run_virtual(main)
    assert isinstance(first, RequestTimeoutError)  # failed at the timeout; not re-queued when the replica is lost later
    assert stats["requeued"] == 0 and len(calls) == 1 and stats["timed_out"] == 1 and stats["failed"] == 0
    assert stats["replicas_lost_total"] == 1 and stats["replicas_timed_out"] == 0
    if replace:
        assert stats["replicas_replaced_total"] == 1 and stats["replicas_free"] == 2 and stats["replicas_lost"] == 0
    else:
        assert stats["replicas_lost"] == 1 and stats["replicas_free"] == 1


def test_a_replica_lost_while_closing_fails_its_requests_instead_of_requeueing_them():
    async def main():
        fn = Replicas(delay_s=1.0)
        fn.dead.add("r0")
        replaced = []

        async def replace(replica, index):
            replaced.append(index)
            return "never used"

        batcher = Batcher(fn, BatchPolicy(max_batch_size=2, max_wait_ms=0), replicas=["r0"],
                                          replace_replica=replace)
        running = spawn(batcher, ["a", "b"])
        await asyncio.sleep(0.5)  # the batch is running on r0, which will turn out dead
        await batcher.aclose(grace_s=5.0)
        return await asyncio.gather(*running, return_exceptions=True), replaced

    outcomes, replaced = run_virtual(main)
    assert [type(o).__name__ for o in outcomes] == ["BatcherClosedError"] * 2  # not stranded in a dead queue
    assert replaced == []  # no replica is started while shutting down
