"""Fuzz: random arrival patterns, replica counts, policies, failures, cancellations, deadlines, flushes, crashes of the
loop and shutdowns, on the virtual-time loop (deterministic; a hang raises instead of blocking).

Replicas die too (a call raises ReplicaLostError; the batcher re-queues its requests and asks for a replacement, which may
fail). Invariants checked on every run: every submitted request resolves exactly once, with an outcome it is allowed to
have; no batch exceeds ``max_batch_size`` or (unless alone) ``max_batch_tokens``; no replica runs two calls at once; a
request that was settled before being dispatched (cancelled, timed out, closed, crashed) never reaches ``batch_fn``; the
statistics add up; the batcher ends idle.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_async_rm.errors import (
    BatchResultError,
    BatcherClosedError,
    BatcherCrashedError,
    NoReplicasError,
    RequestTimeoutError,
    ReplicaLostError,
)
from verl_async_rm.service.batcher import Batcher
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.testing.batcher import run_virtual

pytestmark = pytest.mark.unit


class Poison(Exception):
    """A batch containing a poison item raises this."""


class ItemError(Exception):
    """Returned (not raised) for one item."""


@dataclass
class Scenario:
    seed: int
    requests: int
    replicas: int
    max_batch_size: int
    max_batch_tokens: int | None
    max_wait_ms: float
    default_deadline_s: float | None  # the deadline of requests that give none
    batch_timeout_s: float | None
    group_by_length: bool
    mean_gap_s: float
    p_cancel: float
    p_deadline: float
    p_item_error: float
    p_poison: float
    p_wrong_length: float
    p_flush: float
    crash_at: int | None  # make the loop raise on this call of the flush rule (RequestQueue.departure)
    close_at_s: float | None  # aclose at this virtual time (else: wait for everything, then close)
    p_kill: float = 0.0  # a call's replica dies under it
    p_replace_fail: float = 0.0  # a replacement of a dead replica fails


def random_scenario(rng: random.Random, requests: int) -> Scenario:
    cap = rng.choice([1, 2, 3, 4, 8, 16])
    return Scenario(
        seed=rng.randrange(2**32),
        requests=requests,
        replicas=rng.randint(1, 4),
        max_batch_size=cap,
        max_batch_tokens=rng.choice([None, None, rng.randint(20, 300)]),
        max_wait_ms=rng.choice([0.0, 1.0, 5.0, 20.0]),
        default_deadline_s=rng.choice([None, None, rng.uniform(0.005, 0.3)]),
        batch_timeout_s=rng.choice([None, None, rng.uniform(0.02, 0.2)]),
        group_by_length=rng.random() < 0.5,
        mean_gap_s=rng.choice([0.0, 0.0005, 0.002, 0.01]),
        p_cancel=rng.choice([0.0, 0.05, 0.2]),
        p_deadline=rng.choice([0.0, 0.1, 0.3]),
        p_item_error=rng.choice([0.0, 0.05]),
        p_poison=rng.choice([0.0, 0.02, 0.1]),
        p_wrong_length=rng.choice([0.0, 0.0, 0.05]),
        p_flush=rng.choice([0.0, 0.02]),
        crash_at=rng.choice([None, None, None, rng.randint(1, 50)]),
        close_at_s=rng.choice([None, None, None, rng.uniform(0.0, 0.2)]),
        p_kill=rng.choice([0.0, 0.0, 0.02, 0.1]),
        p_replace_fail=rng.choice([0.0, 0.3, 1.0]),
    )


@dataclass
class Req:
    i: int
    tokens: int | None
    gap_s: float
    deadline_s: float | None
    cancel_after_s: float | None
    kind: str  # ok | item_error | poison
    outcome: object = None
    settled_unseen: bool = False  # resolved without a result before batch_fn ever saw it


@dataclass
class FuzzBatchFn:
    """Random execution times; raises on poison; returns ItemError for item_error; sometimes a wrong length."""

    reqs: list[Req]
    rng: random.Random
    p_wrong_length: float
    p_kill: float = 0.0
    p_replace_fail: float = 0.0
    dead: set = field(default_factory=set)
    replaced: int = 0
    calls: list[tuple[list[int], object]] = field(default_factory=list)
    busy: set = field(default_factory=set)
    seen: set = field(default_factory=set)
    overlaps: int = 0

    async def __call__(self, items: list[int], replica: object, deadline) -> list[object]:
        self.calls.append((list(items), replica))
        self.seen.update(items)
        if replica in self.busy:
            self.overlaps += 1
        self.busy.add(replica)
        try:
            if self.rng.random() < self.p_kill:
                self.dead.add(replica)
            exec_s = self.rng.choice([0.0, 0.0005, 0.002, 0.01, 0.03, 0.3 if self.rng.random() < 0.05 else 0.001])
            if exec_s:
                await asyncio.sleep(exec_s)
            if replica in self.dead:
                raise ReplicaLostError(f"{replica} died")
            if any(self.reqs[i].kind == "poison" for i in items):
                raise Poison(f"poison in {items}")
            out: list[object] = [ItemError(i) if self.reqs[i].kind == "item_error" else i * 2 for i in items]
            if self.rng.random() < self.p_wrong_length:
                out.pop()
            return out
        finally:
            self.busy.discard(replica)

    async def replace(self, replica: object, index: int) -> object:
        await asyncio.sleep(self.rng.choice([0.0, 0.005, 0.05]))
        if self.rng.random() < self.p_replace_fail:
            raise RuntimeError(f"no room for a new {replica}")
        self.replaced += 1
        return f"{replica}'"


def run_scenario(sc: Scenario) -> dict:
    rng = random.Random(sc.seed)
    needs_tokens = sc.max_batch_tokens is not None
    reqs = [
        Req(
            i=i,
            tokens=rng.randint(1, 400) if needs_tokens or rng.random() < 0.7 else None,
            gap_s=0.0 if rng.random() < 0.3 else rng.expovariate(1 / sc.mean_gap_s) if sc.mean_gap_s else 0.0,
            deadline_s=rng.uniform(0.001, 0.1) if rng.random() < sc.p_deadline else None,
            cancel_after_s=rng.uniform(0.0, 0.05) if rng.random() < sc.p_cancel else None,
            kind=rng.choices(["ok", "item_error", "poison"], [1 - sc.p_item_error - sc.p_poison, sc.p_item_error,
                                                               sc.p_poison])[0],
        )
        for i in range(sc.requests)
    ]
    policy = BatchPolicy(
        max_batch_size=sc.max_batch_size, max_batch_tokens=sc.max_batch_tokens, max_wait_ms=sc.max_wait_ms,
        batch_timeout_s=sc.batch_timeout_s, group_by_length=sc.group_by_length,
    )
    fn = FuzzBatchFn(reqs, random.Random(sc.seed + 1), sc.p_wrong_length, sc.p_kill, sc.p_replace_fail)
    cancelled_by_us: set[int] = set()

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        batcher = Batcher(fn, policy, replicas=[f"replica{k}" for k in range(sc.replicas)],
                                          replace_replica=fn.replace)
        if sc.crash_at is not None:
            real, count = batcher._queue.departure, [0]

            def flaky(now: float):
                count[0] += 1
                if count[0] == sc.crash_at:
                    raise RuntimeError("injected crash")
                return real(now)

            batcher._queue.departure = flaky

        async def call(req: Req) -> None:
            try:
                deadline_s = sc.default_deadline_s if req.deadline_s is None else req.deadline_s
                req.outcome = await batcher.submit(req.i, num_tokens=req.tokens, deadline_s=deadline_s)
            except asyncio.CancelledError as exc:
                req.outcome = exc
            except Exception as exc:  # noqa: BLE001 - recorded and checked below
                req.outcome = exc
            if not isinstance(req.outcome, int) and req.i not in fn.seen:
                req.settled_unseen = True

        def cancel_later(task: asyncio.Task, req: Req) -> None:
            if not task.done():
                cancelled_by_us.add(req.i)
                task.cancel()

        closer = None
        if sc.close_at_s is not None:
            closer = loop.call_later(sc.close_at_s, lambda: asyncio.ensure_future(batcher.aclose(grace_s=0.05)))
        tasks = []
        for req in reqs:
            if req.gap_s:
                await asyncio.sleep(req.gap_s)
            task = asyncio.ensure_future(call(req))
            tasks.append(task)
            if req.cancel_after_s is not None:
                loop.call_later(req.cancel_after_s, cancel_later, task, req)
            if rng.random() < sc.p_flush:
                batcher.flush()
            elif rng.random() < 0.01:
                batcher.flush_after(rng.randint(1, 10))
        batcher.flush()
        await asyncio.gather(*tasks)
        if closer is not None:
            closer.cancel()
        while batcher.stats()["in_flight_batches"]:  # an aclose in progress, or abandoned timeouts
            await asyncio.sleep(0.01)
        stats = batcher.stats()
        await batcher.aclose()
        return stats

    stats = run_virtual(main, timeout_s=10_000.0)
    check(sc, reqs, fn, stats, cancelled_by_us)
    return stats


def check(sc: Scenario, reqs: list[Req], fn: FuzzBatchFn, stats: dict, cancelled_by_us: set[int]) -> None:
    closed = sc.close_at_s is not None
    deadlines = sc.default_deadline_s is not None or sc.batch_timeout_s is not None
    for req in reqs:
        o = req.outcome
        assert o is not None, f"request {req.i} never resolved"
        if isinstance(o, int):
            assert o == req.i * 2 and req.kind == "ok", (req, o)
        elif isinstance(o, asyncio.CancelledError):
            assert req.i in cancelled_by_us, req
        elif isinstance(o, ItemError):
            assert req.kind == "item_error" and o.args == (req.i,), (req, o)  # only its own caller
        elif isinstance(o, Poison):
            assert req.i in fn.seen, req
        elif isinstance(o, RequestTimeoutError):
            assert deadlines or req.deadline_s is not None, (req, o)
        elif isinstance(o, BatcherClosedError):
            assert closed, req
        elif isinstance(o, BatcherCrashedError):
            assert sc.crash_at is not None, (req, o)
        elif isinstance(o, ReplicaLostError):  # re-queued replica_retries times, each time onto a replica that died
            assert sc.p_kill > 0 and req.i in fn.seen, req
        elif isinstance(o, NoReplicasError):  # every replica died and could not be replaced
            assert sc.p_kill > 0 and sc.p_replace_fail > 0, req
        elif isinstance(o, BatchResultError):
            assert sc.p_wrong_length > 0 and req.i in fn.seen, req
        else:
            raise AssertionError(f"unexpected outcome for {req}: {o!r}")
        if req.settled_unseen:
            assert req.i not in fn.seen, f"request {req.i} reached batch_fn after it was settled ({o!r})"
    max_calls_per_item = 1 + BatchPolicy().replica_retries  # each re-queue after a lost replica may run it again
    per_item: dict[int, int] = {}
    for items, _ in fn.calls:
        assert 1 <= len(items) <= sc.max_batch_size, items
        if sc.max_batch_tokens is not None and len(items) > 1:
            assert sum(reqs[i].tokens for i in items) <= sc.max_batch_tokens, items
        for i in items:
            per_item[i] = per_item.get(i, 0) + 1
    assert max(per_item.values(), default=0) <= max_calls_per_item
    assert fn.overlaps == 0, "a replica ran two batches at once"
    values = sum(isinstance(r.outcome, int) for r in reqs)
    settled = stats["completed"] + stats["failed"] + stats["timed_out"] + stats["cancelled"]
    assert settled == stats["submitted"], stats
    assert stats["submitted"] + stats["rejected"] == len(reqs), stats
    assert values <= stats["completed"] <= values + len(cancelled_by_us)
    assert stats["queue_len"] == stats["in_flight_batches"] == stats["in_flight_requests"] == 0
    assert stats["replicas_free"] + stats["replicas_lost"] == sc.replicas
    assert stats["replicas_lost_total"] == stats["replicas_replaced_total"] + stats["replicas_replace_failed_total"]


@pytest.mark.parametrize("seed", range(40))
def test_fuzz_seeded_ten_thousand_arrivals(seed):
    """40 seeds x 250 arrivals = 10^4 random arrivals in all."""
    scenario = random_scenario(random.Random(seed), requests=250)
    run_scenario(scenario)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    requests=st.integers(1, 60),
    replicas=st.integers(1, 4),
    cap=st.sampled_from([1, 2, 3, 5, 8]),
    tokens=st.one_of(st.none(), st.integers(1, 500)),
    max_wait_ms=st.sampled_from([0.0, 1.0, 10.0]),
    group=st.booleans(),
    p_cancel=st.sampled_from([0.0, 0.3]),
    p_deadline=st.sampled_from([0.0, 0.3]),
    p_poison=st.sampled_from([0.0, 0.1]),
    crash_at=st.one_of(st.none(), st.integers(1, 20)),
    close_at_s=st.one_of(st.none(), st.floats(0.0, 0.05)),
)
def test_fuzz_hypothesis(seed, requests, replicas, cap, tokens, max_wait_ms, group,
                         p_cancel, p_deadline, p_poison, crash_at, close_at_s):
    run_scenario(Scenario(
        seed=seed, requests=requests, replicas=replicas, max_batch_size=cap, max_batch_tokens=tokens,
        max_wait_ms=max_wait_ms, default_deadline_s=None,
        batch_timeout_s=0.1, group_by_length=group, mean_gap_s=0.001, p_cancel=p_cancel,
        p_deadline=p_deadline, p_item_error=0.05, p_poison=p_poison, p_wrong_length=0.05, p_flush=0.05,
        crash_at=crash_at, close_at_s=close_at_s,
    ))
