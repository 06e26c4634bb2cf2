"""Batch formation: replicas, flush triggers (size, tokens, age, flush, flush_after), token budget, length grouping.

Most tests run on a virtual-time loop (``run_virtual``): timers fire exactly, and time only moves when every task
waits, so "resolves within max_wait + execution" is checked exactly and without real waiting. Batch functions are
gated on events; nothing sleeps for correctness.
"""

from __future__ import annotations

import asyncio

import pytest

from verl_async_rm.service.batcher import Batcher

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.service.batching import select_batch
from verl_async_rm.service.batching import Request
from verl_async_rm.testing.batcher import GatedBatchFn, run_virtual

pytestmark = pytest.mark.unit

HOUR_MS = 3_600_000.0  # a max_wait that never fires within a test


def spawn(batcher, items, **kwargs):
    return [asyncio.ensure_future(batcher.submit(item, **kwargs)) for item in items]


async def idle(seconds: float = 0.0) -> None:
    """Let every ready task run (and, on the virtual loop, let ``seconds`` of virtual time pass)."""
    for _ in range(5):
        await asyncio.sleep(0)
    if seconds:
        await asyncio.sleep(seconds)


@pytest.mark.asyncio
@pytest.mark.parametrize("k", [1, 3])
async def test_burst_of_k_times_n_flushes_full_batches_at_once(k):
    """Real event loop: k*N requests at once give k batches of exactly N, without waiting for max_wait."""
    n = 8
    fn = GatedBatchFn(lambda x: x + 1000)
    batcher = Batcher(fn, BatchPolicy(max_batch_size=n, max_wait_ms=HOUR_MS), replicas=k)
    tasks = spawn(batcher, range(k * n))
    await asyncio.wait_for(fn.wait_calls(k), 60)
    assert fn.batch_sizes == [n] * k and not any(t.done() for t in tasks)
    fn.open()
    assert await asyncio.wait_for(asyncio.gather(*tasks), 60) == [i + 1000 for i in range(k * n)]
    stats = batcher.stats()
    assert stats["flush_reasons"]["size"] == k and stats["flush_reasons"]["age"] == 0
    assert stats["completed"] == k * n and stats["mean_fill"] == 1.0
    await batcher.aclose()


@pytest.mark.parametrize("count", [1, 7, 9, 19])  # 1, N-1, N+1, 2N+3 with N=8
def test_every_count_resolves_within_max_wait_plus_execution(count):
    n, wait_s, exec_s = 8, 0.020, 0.050

    async def main():
        loop = asyncio.get_running_loop()
        fn = GatedBatchFn(open=True, delay_s=exec_s)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=n, max_wait_ms=wait_s * 1000), replicas=3)
        done_at = {}

        async def one(i):
            t0 = loop.time()
            assert await batcher.submit(i) == i
            done_at[i] = loop.time() - t0

        await asyncio.gather(*(one(i) for i in range(count)))
        await batcher.aclose()
        return done_at, fn.batch_sizes

    done_at, sizes = run_virtual(main)
    assert len(done_at) == count
    assert max(done_at.values()) <= wait_s + exec_s + 1e-9
    assert sum(sizes) == count and max(sizes) <= n
    if count < n:
        assert min(done_at.values()) == pytest.approx(wait_s + exec_s)  # a partial batch waits exactly max_wait


def test_lone_request_waits_exactly_max_wait_then_runs():
    async def main():
        loop = asyncio.get_running_loop()
        fn = GatedBatchFn(open=True, delay_s=0.010)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=64, max_wait_ms=25))
        latencies = []
        for i in range(3):
            t0 = loop.time()
            await batcher.submit(i)
            latencies.append(loop.time() - t0)
            await asyncio.sleep(1.0)  # low load: the next request arrives long after
        stats = batcher.stats()
        await batcher.aclose()
        return latencies, stats

    latencies, stats = run_virtual(main)
    assert latencies == [pytest.approx(0.035)] * 3
    assert stats["flush_reasons"]["age"] == 3 and stats["wait_ms"]["max"] == pytest.approx(25.0)


def test_max_wait_zero_is_work_conserving():
    async def main():
        fn = GatedBatchFn(open=True, delay_s=0.010)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=8, max_wait_ms=0), replicas=2)
        first = spawn(batcher, ["a"])
        await idle()
        assert fn.batch_sizes == [1]  # an idle replica takes the lone request at once
        rest = spawn(batcher, ["b", "c", "d"])
        await asyncio.gather(*first, *rest)
        await batcher.aclose()
        return fn.batch_sizes

    assert run_virtual(main) == [1, 3]


def test_flush_sends_a_partial_batch_at_once_and_later_requests_wait():
    async def main():
        loop = asyncio.get_running_loop()
        fn = GatedBatchFn(open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=8, max_wait_ms=HOUR_MS))
        tasks = spawn(batcher, range(5))
        await idle(10.0)
        assert fn.calls == [] and not any(t.done() for t in tasks)
        t_flush = loop.time()
        assert batcher.flush() == 5
        await asyncio.gather(*tasks)
        assert loop.time() == t_flush  # no waiting at all
        late = spawn(batcher, ["late"])
        await idle(10.0)
        assert not late[0].done()  # requests after the flush wait as usual
        batcher.flush()
        await late[0]
        stats = batcher.stats()
        await batcher.aclose()
        return fn.batch_sizes, stats

    sizes, stats = run_virtual(main)
    assert sizes == [5, 1] and stats["flush_reasons"]["flush"] == 2


def test_flush_splits_evenly_across_free_replicas():
    async def main():
        fn = GatedBatchFn()
        batcher = Batcher(fn, BatchPolicy(max_batch_size=16, max_wait_ms=HOUR_MS), replicas=3)
        tasks = spawn(batcher, range(10))
        await idle()
        batcher.flush()
        await fn.wait_calls(3)
        fn.open()
        await asyncio.gather(*tasks)
        await batcher.aclose()
        return sorted(fn.batch_sizes), {replica for _, replica in fn.calls}

    sizes, replicas = run_virtual(main)
    assert sizes == [3, 3, 4] and replicas == {0, 1, 2}


def test_a_flush_that_also_fills_the_batch_is_split_over_the_free_replicas():
    """flush_after(n) with n = max_batch_size: the step's last request both fills the batch and ends the step; what
    the flush covers still leaves split over the free replicas, not as one batch on one of them."""
    async def main():
        fn = GatedBatchFn()
        batcher = Batcher(fn, BatchPolicy(max_batch_size=8, max_wait_ms=HOUR_MS), replicas=2)
        batcher.flush_after(8)
        tasks = spawn(batcher, range(8))
        await fn.wait_calls(2)
        fn.open()
        await asyncio.gather(*tasks)
        await batcher.aclose()
        return sorted(fn.batch_sizes), {replica for _, replica in fn.calls}

    sizes, replicas = run_virtual(main)
    assert sizes == [4, 4] and replicas == {0, 1}


def test_expect_flushes_on_the_nth_request_of_the_step():
    async def main():
        fn = GatedBatchFn(open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=16, max_wait_ms=HOUR_MS))
        early = spawn(batcher, range(2))  # arrive before expect(): they belong to this step too
        await idle()
        batcher.flush_after(5)
        more = spawn(batcher, range(2, 4))
        await idle(1.0)
        assert fn.calls == []
        last = spawn(batcher, [4])
        await asyncio.gather(*early, *more, *last)
        # the next step: expect() after all its requests arrived flushes at once
        nxt = spawn(batcher, range(10, 13))
        await idle()
        assert fn.batch_sizes == [5]
        batcher.flush_after(3)
        await asyncio.gather(*nxt)
        stats = batcher.stats()
        await batcher.aclose()
        return fn.batch_sizes, stats

    sizes, stats = run_virtual(main)
    assert sizes == [5, 3] and stats["flush_reasons"]["flush"] == 2


def test_saturation_grows_batches_to_the_cap():
    """Arrivals faster than the RM: while the replica is busy requests pile up, so every batch leaves full."""
    cap, exec_s = 16, 0.050

    async def main():
        fn = GatedBatchFn(open=True, delay_s=exec_s)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=cap, max_wait_ms=5))
        tasks = []
        for i in range(20 * cap):
            tasks.append(asyncio.ensure_future(batcher.submit(i)))
            await asyncio.sleep(exec_s / (2 * cap))  # twice the rate one replica can serve
        await asyncio.gather(*tasks)
        stats = batcher.stats()
        await batcher.aclose()
        return fn.batch_sizes, stats

    sizes, stats = run_virtual(main)
    assert sum(sizes) == 20 * cap
    assert all(size == cap for size in sizes[1:-1]), sizes
    assert stats["mean_fill"] >= 0.9


def test_an_idle_replica_never_waits_for_a_busy_one():
    async def main():
        fn = GatedBatchFn()
        batcher = Batcher(fn, BatchPolicy(max_batch_size=4, max_wait_ms=HOUR_MS),
                                          replicas=["replica-a", "replica-b"])
        first = spawn(batcher, range(4))
        await fn.wait_calls(1)
        second = spawn(batcher, range(4, 8))  # replica-a is still busy: replica-b takes the next full batch
        await fn.wait_calls(2)
        assert [replica for _, replica in fn.calls] == ["replica-a", "replica-b"]
        third = spawn(batcher, range(8, 12))
        await idle()
        assert len(fn.calls) == 2 and batcher.stats()["queue_len"] == 4  # no replica free: no batch is formed
        fn.open()
        await asyncio.gather(*first, *second, *third)
        await batcher.aclose()
        return fn.max_active

    assert run_virtual(main) == 2


def test_token_budget_flushes_at_once_and_caps_tokens():
    async def main():
        fn = GatedBatchFn(open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=64, max_batch_tokens=100,
                                                          max_wait_ms=HOUR_MS))
        await asyncio.gather(*spawn(batcher, range(9), num_tokens=30))
        stats = batcher.stats()
        await batcher.aclose()
        return fn.batch_sizes, stats

    sizes, stats = run_virtual(main)
    assert sizes[:2] == [3, 3] and sum(sizes) == 9
    assert stats["flush_reasons"]["tokens"] >= 2


@pytest.mark.parametrize("group", [False, True])
def test_oversized_item_goes_alone_and_a_deferred_item_keeps_its_place(group):
    async def main():
        fn = GatedBatchFn(open=True)
        policy = BatchPolicy(max_batch_size=8, max_batch_tokens=100, max_wait_ms=HOUR_MS, group_by_length=group)
        batcher = Batcher(fn, policy)
        tasks = []
        for name, tokens in [("huge", 150), ("a60", 60), ("b50", 50), ("c10", 10)]:
            tasks.append(asyncio.ensure_future(batcher.submit(name, num_tokens=tokens)))
        await idle()
        batcher.flush()
        await asyncio.gather(*tasks)
        await batcher.aclose()
        return [items for items, _ in fn.calls]

    calls = run_virtual(main)
    assert calls[0] == ["huge"]
    if group:  # grouping may fill the room the deferred b50 leaves, but b50 still opens the next batch
        assert calls[1:] == [["a60", "c10"], ["b50"]]
    else:
        assert calls[1:] == [["a60"], ["b50", "c10"]]


def _lengths_run(group: bool):
    async def main():
        fn = GatedBatchFn()
        policy = BatchPolicy(max_batch_size=8, max_wait_ms=HOUR_MS, group_by_length=group)
        batcher = Batcher(fn, policy)
        blocker = spawn(batcher, ["blocker"] * 8, num_tokens=5)  # fills and holds the only replica
        await fn.wait_calls(1)
        lengths = [10, 1000] * 8
        tasks = [asyncio.ensure_future(batcher.submit(n, num_tokens=n)) for n in lengths]
        await idle()
        fn.open()
        await asyncio.gather(*blocker, *tasks)
        stats = batcher.stats()
        await batcher.aclose()
        return [items for items, _ in fn.calls[1:]], stats

    return run_virtual(main)


def test_length_grouping_cuts_padding():
    grouped, grouped_stats = _lengths_run(True)
    mixed, mixed_stats = _lengths_run(False)
    assert grouped == [[10] * 8, [1000] * 8]
    assert all(len(set(batch)) == 2 for batch in mixed)
    assert grouped_stats["padding_fraction"] == 0.0 < mixed_stats["padding_fraction"]


def _req(seq, tokens, t):
    return Request(seq, f"r{seq}", tokens, t, None, None)  # type: ignore[arg-type]


def test_grouping_takes_every_due_request_before_closer_younger_ones():
    # r1 (short) and r2 (long) are due; r3..r9 (short, closer to r1's length) are not.
    queue = [_req(1, 10, 0.0), _req(2, 900, 0.0)] + [_req(i, 10, 5.0) for i in range(3, 10)]
    picked = select_batch(queue, count=len(queue), pending_tokens=sum(r.num_tokens for r in queue), max_items=4,
                          max_tokens=None, due_before=1.0, group_by_length=True, window=16)
    assert [r.seq for r in picked] == [1, 2, 3, 4]


def test_grouping_prefers_due_requests_even_after_a_token_deferral():
    queue = [_req(1, 50, 0.0), _req(2, 60, 0.0), _req(3, 40, 0.0), _req(4, 50, 5.0)]
    picked = select_batch(queue, count=4, pending_tokens=200, max_items=4, max_tokens=100, due_before=1.0,
                          group_by_length=True, window=16)
    assert [r.seq for r in picked] == [1, 3]  # r2 deferred (does not fit), r3 due goes before the closer r4


def test_select_batch_respects_both_caps():
    queue = [_req(i, 7, 0.0) for i in range(1, 30)]
    for max_items, max_tokens in [(4, None), (64, 30), (3, 100), (1, None)]:
        picked = select_batch(queue, count=len(queue), pending_tokens=7 * 29, max_items=max_items,
                              max_tokens=max_tokens, due_before=-1.0, group_by_length=True, window=8)
        assert 1 <= len(picked) <= max_items
        assert max_tokens is None or sum(r.num_tokens for r in picked) <= max_tokens
        assert picked[0].seq == 1  # the oldest request always leaves first


def test_expect_adds_up_across_overlapping_dispatches():
    """Two batches dispatched before either finishes announce 3 + 2: the flush waits for all 5, not for 3."""

    async def main():
        fn = GatedBatchFn(open=True)
        batcher = Batcher(fn, BatchPolicy(max_batch_size=16, max_wait_ms=HOUR_MS))
        batcher.flush_after(3)
        batcher.flush_after(2)
        first = spawn(batcher, range(3))
        await idle(1.0)
        assert fn.calls == []  # 3 of the 5 expected: still waiting
        rest = spawn(batcher, range(3, 5))
        await asyncio.gather(*first, *rest)
        await batcher.aclose()
        return fn.batch_sizes

    assert run_virtual(main) == [5]


def test_the_flush_rule_says_now_and_why_or_until_when():
    """``RequestQueue.departure`` is the one place the flush rule is written: the loop both flushes and sleeps by it."""
    from verl_async_rm.service.batching import RequestQueue

    room = RequestQueue(BatchPolicy(max_batch_size=3, max_batch_tokens=100, max_wait_ms=10))
    loop = asyncio.new_event_loop()
    try:
        def put(seq, t, tokens):
            room.put(Request(seq, seq, tokens, t, loop.create_future(), None))

        assert room.departure(0.0) == (None, None)  # nothing to wait for
        put(1, 1.0, 10)
        assert room.departure(1.0) == (None, pytest.approx(1.010))  # not before the oldest has waited max_wait
        put(2, 1.005, 10)
        assert room.departure(1.005) == (None, pytest.approx(1.010))  # the OLDEST request sets the time
        assert room.departure(1.010) == ("age", None)
        room.flush_seq = 2
        assert room.departure(1.006) == ("flush", None)
        room.flush_seq = 0
        put(3, 1.007, 90)
        assert room.departure(1.007) == ("size", None)
        room.clear()
        put(4, 1.008, 100)
        assert room.departure(1.008) == ("tokens", None)
    finally:
        loop.close()
