"""Batch formation under a backlog: length grouping among overdue requests, the oldest always leaves, bounded pass-over.

``select_batch`` is pure, so most tests drive it directly on hand-built queues and replay many formations on seeded
random queues. One test runs the batcher on the virtual-time loop with a gated batch function (no sleeps).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from verl_async_rm.service.batcher import Batcher

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.service.batching import select_batch
from verl_async_rm.service.batching import Request
from verl_async_rm.testing.batcher import GatedBatchFn, run_virtual

pytestmark = pytest.mark.unit


def _req(seq: int, tokens: int | None, t: float = 0.0, group: str | None = None) -> Request:
    return Request(seq, f"r{seq}", tokens, t, None, None, group)  # type: ignore[arg-type]


def _select(queue, *, max_items, max_tokens=None, due_before=1e9, group=True, window=None, siblings=False):
    return select_batch(
        queue, count=len(queue), pending_tokens=sum(r.num_tokens or 0 for r in queue), max_items=max_items,
        max_tokens=max_tokens, due_before=due_before, group_by_length=group,
        window=4 * max_items if window is None else window, prefer_siblings=siblings,
    )


def test_a_backlog_of_overdue_requests_is_grouped_by_length():
    """Every request is due (a backlog): the batch still takes the lengths closest to the oldest one's."""
    queue = [_req(i, 10 if i % 2 else 1000) for i in range(1, 33)]  # 10, 1000, 10, 1000, ...
    picked = _select(queue, max_items=8)
    assert picked[0].seq == 1
    assert [r.num_tokens for r in picked] == [10] * 8
    assert [r.seq for r in picked] == [1, 3, 5, 7, 9, 11, 13, 15]  # among equals, oldest first


def test_without_grouping_a_backlog_stays_strict_fifo():
    queue = [_req(i, 10 if i % 2 else 1000) for i in range(1, 33)]
    assert [r.seq for r in _select(queue, max_items=8, group=False)] == list(range(1, 9))
    # with a token budget FIFO stops at the first request that does not fit (it opens the next batch)
    assert [r.seq for r in _select(queue, max_items=8, max_tokens=1500, group=False)] == [1, 2, 3]


def test_due_requests_still_go_before_younger_ones_of_closer_length():
    # r1..r4 due (two short, two long); r5..r12 short like the head but not due
    queue = [_req(1, 10), _req(2, 900), _req(3, 900), _req(4, 10)] + [_req(i, 10, 5.0) for i in range(5, 13)]
    picked = _select(queue, max_items=6, due_before=1.0)
    assert [r.seq for r in picked] == [1, 4, 2, 3, 5, 6]  # due: closest first; then the closest younger ones


def test_grouping_skips_what_does_not_fit_the_budget_and_an_oversized_head_goes_alone():
    queue = [_req(1, 60), _req(2, 55), _req(3, 70), _req(4, 30), _req(5, 5)]
    picked = _select(queue, max_items=8, max_tokens=100)
    assert [r.seq for r in picked] == [1, 4, 5]  # r2 (closest) and r3 do not fit next to r1: skipped, kept
    oversized = [_req(1, 500), _req(2, 10), _req(3, 10)]
    assert [r.seq for r in _select(oversized, max_items=8, max_tokens=100)] == [1]


def _replay(queue, *, max_items, max_tokens, window, arrivals, due_lag=0.0, siblings=False):
    """Form batches (with grouping) until the queue is empty, appending ``arrivals(round, now)`` after each batch.

    Checks every batch's invariants and returns, per request, how many batches passed it over (took a younger request
    while it stayed), the round and number of requests ahead of it when it entered the window, and the round it left.
    """
    passed_over: dict[int, int] = {}
    entered: dict[int, tuple[int, int]] = {}
    left: dict[int, int] = {}
    now = 0.0
    for rnd in range(100_000):
        if not queue:
            break
        for pos, req in enumerate(queue[:window + 1]):
            entered.setdefault(req.seq, (rnd, pos))
        due_before = now - due_lag
        picked = _select(queue, max_items=max_items, max_tokens=max_tokens, due_before=due_before, window=window,
                         siblings=siblings)
        seqs = [r.seq for r in picked]
        assert picked and picked[0] is queue[0]  # the oldest request is always taken
        assert len(set(seqs)) == len(seqs) <= max_items
        assert max_tokens is None or len(picked) == 1 or sum(r.num_tokens for r in picked) <= max_tokens
        taken = set(seqs)
        room = None if max_tokens is None else max_tokens - sum(r.num_tokens for r in picked)
        due_left_in_window = any(  # a due request left behind that would still have fitted
            r.t_submit <= due_before and (room is None or r.num_tokens <= room)
            for r in queue[1:window + 1] if r.seq not in taken)
        youngest = max(seqs)
        for pos, req in enumerate(queue):
            if req.seq in taken:
                left[req.seq] = rnd
                if due_left_in_window:  # a request that is not due never goes while a due one that fits stays
                    assert req.t_submit <= due_before
            elif req.seq < youngest:
                passed_over[req.seq] = passed_over.get(req.seq, 0) + 1
                assert 1 <= pos <= window  # only a request inside the window can be passed over
        queue[:] = [r for r in queue if r.seq not in taken]
        now += 1.0
        queue.extend(arrivals(rnd, now))
    assert not queue
    return passed_over, entered, left


@pytest.mark.parametrize("max_tokens", [None, 4000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_request_is_passed_over_more_than_window_times(seed, max_tokens):
    """Random lengths and a stream of arrivals keep a backlog: every request leaves, none is passed over more than
    ``window`` times, and one with ``p`` requests ahead when it entered the window leaves within ``p + 1`` batches."""
    rng = random.Random(seed)
    max_items, window = 8, 32
    seq = iter(range(1, 10**9))

    def length():
        return int(rng.lognormvariate(5.5, 1.0)) + 1

    queue = [_req(next(seq), length(), 0.0) for _ in range(200)]

    def arrivals(rnd, now):
        return [_req(next(seq), length(), now) for _ in range(rng.randint(0, 12))] if rnd < 300 else []

    passed_over, entered, left = _replay(queue, max_items=max_items, max_tokens=max_tokens, window=window,
                                         arrivals=arrivals, due_lag=3.0)
    assert sum(passed_over.values()) > 0  # the scenario does pass requests over (strict FIFO never would)
    assert max(passed_over.values()) <= window
    assert set(left) == set(entered)
    for s, (rnd, ahead) in entered.items():
        assert left[s] - rnd <= ahead, (s, rnd, ahead, left[s])


def test_an_outlier_among_overdue_requests_is_passed_over_then_taken_as_the_head():
    """A long request among a stream of short ones is passed over while inside the window, and taken at the latest
    when it reaches the head: with ``p`` requests ahead of it, within ``p + 1`` batches."""
    max_items, window = 4, 16
    queue = [_req(i, 10) for i in range(1, 10)] + [_req(10, 5000)] + [_req(i, 10) for i in range(11, 41)]
    counter = iter(range(41, 10**9))

    def arrivals(rnd, now):  # short requests keep coming, so there is always a closer choice than the outlier
        return [_req(next(counter), 10, now) for _ in range(max_items)] if rnd < 50 else []

    passed_over, _, left = _replay(queue, max_items=max_items, max_tokens=None, window=window, arrivals=arrivals)
    assert 0 < passed_over[10] <= window
    assert left[10] <= 9  # 9 requests ahead of it at the start: it leaves within 9 + 1 batches (round 0..9)
    assert all(count == 0 for seq, count in passed_over.items() if seq != 10)  # only the outlier was skipped


def test_batcher_groups_a_backlog_that_is_already_past_max_wait():
    """On the batcher: while the only replica is busy, mixed lengths pile up past max_wait; the batches that follow are
    grouped by length (no padding), and the oldest request is in the first one."""

    def run(group: bool):
        async def main():
            fn = GatedBatchFn()
            policy = BatchPolicy(max_batch_size=8, max_wait_ms=5, group_by_length=group)
            batcher = Batcher(fn, policy)
            blocker = asyncio.ensure_future(batcher.submit("blocker", num_tokens=5))
            await fn.wait_calls(1)
            lengths = [10, 1000] * 8
            tasks = [asyncio.ensure_future(batcher.submit(n, num_tokens=n)) for n in lengths]
            await asyncio.sleep(1.0)  # virtual time: every queued request is now long past max_wait
            assert fn.batch_sizes == [1]
            fn.open()
            await asyncio.gather(blocker, *tasks)
            stats = batcher.stats()
            await batcher.aclose()
            return [items for items, _ in fn.calls[1:]], stats

        return run_virtual(main)

    grouped, grouped_stats = run(True)
    assert grouped == [[10] * 8, [1000] * 8]
    assert grouped_stats["padding_fraction"] == 0.0
    fifo, fifo_stats = run(False)
    assert fifo == [[10, 1000] * 4] * 2 and fifo_stats["padding_fraction"] > 0.4


# --- siblings (GRPO responses to one prompt) -------------------------------------------------------------------------


def test_the_heads_siblings_go_first_whatever_their_length():
    """Every request due: after the head, its siblings (same group), even of far lengths, then the closest lengths."""
    queue = [_req(1, 100, group="a"), _req(2, 100, group="b"), _req(3, 900, group="a"), _req(4, 101, group="c"),
             _req(5, 20, group="a"), _req(6, 99)]
    picked = _select(queue, max_items=4, siblings=True)
    assert [r.seq for r in picked] == [1, 5, 3, 2]  # siblings by closeness, then lengths
    assert [r.seq for r in _select(queue, max_items=4)] == [1, 2, 4, 6]  # prefer_siblings off: lengths only
    assert [r.seq for r in _select(queue, max_items=4, group=False, siblings=True)] == [1, 2, 3, 4]  # FIFO
    ungrouped = [_req(1, 100), _req(2, 900), _req(3, 101, group="x")]
    assert [r.seq for r in _select(ungrouped, max_items=2, siblings=True)] == [1, 3]  # a head without group


def test_a_sibling_that_is_not_due_does_not_pass_a_due_request_nor_break_the_budget():
    queue = [_req(1, 100, 0.0, "a"), _req(2, 500, 0.0, "b"), _req(3, 100, 5.0, "a"), _req(4, 950, 0.0, "a")]
    picked = _select(queue, max_items=3, max_tokens=1000, due_before=1.0, siblings=True)
    assert [r.seq for r in picked] == [1, 2, 3]  # r4 (a due sibling) does not fit next to r1: skipped, kept


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sibling_preference_keeps_the_pass_over_bound(seed):
    """The same replay as above with GRPO-like groups of 8 arriving interleaved: the pass-over bounds still hold."""
    rng = random.Random(seed)
    max_items, window = 8, 32
    seq = iter(range(1, 10**9))

    def group_of_8(now):
        group = f"g{rng.randrange(10**9)}"
        return [_req(next(seq), int(rng.lognormvariate(5.5, 1.0)) + 1, now, group) for _ in range(8)]

    backlog = [r for _ in range(25) for r in group_of_8(0.0)]
    rng.shuffle(backlog)  # siblings arrive apart
    queue = [_req(i, r.num_tokens, 0.0, r.group) for i, r in enumerate(backlog, start=1)]  # arrival order
    seq = iter(range(len(queue) + 1, 10**9))  # later arrivals come after them
    def arrivals(rnd, now):
        return (group_of_8(now) if rng.random() < 0.7 else []) if rnd < 300 else []

    passed_over, entered, left = _replay(queue, max_items=max_items, max_tokens=4000, window=window,
                                         arrivals=arrivals, due_lag=3.0, siblings=True)
    assert max(passed_over.values()) <= window
    assert set(left) == set(entered)
    for s, (rnd, ahead) in entered.items():
        assert left[s] - rnd <= ahead, (s, rnd, ahead, left[s])


def test_batcher_batches_rm_requests_with_their_siblings(policy_tok):
    """RMRequests name their GRPO group: interleaved arrivals still leave in per-prompt batches."""
    from verl_async_rm.request import RMRequest

    def run():
        async def main():
            fn = GatedBatchFn()
            batcher = Batcher(fn, BatchPolicy(max_batch_size=4, max_wait_ms=5, prefer_siblings=True))
            blocker = asyncio.ensure_future(batcher.submit(RMRequest("blocker", [1], [2]), num_tokens=2))
            await fn.wait_calls(1)
            # p0/0, p1/0, p2/0, p0/1, ...: siblings arrive apart, lengths interleaved
            requests = [RMRequest(f"p{p}/{s}", [5] * 10, [6] * (10 + 37 * s + 11 * p), group=f"p{p}") for s in
                        range(4) for p in range(3)]
            tasks = [asyncio.ensure_future(batcher.submit(r, num_tokens=r.num_tokens)) for r in requests]
            await asyncio.sleep(1.0)  # virtual time: a backlog, all past max_wait
            fn.open()
            await asyncio.gather(blocker, *tasks)
            await batcher.aclose()
            return [[r.group for r in items] for items, _ in fn.calls[1:]]

        return run_virtual(main)

    assert run() == [["p0"] * 4, ["p1"] * 4, ["p2"] * 4]
    assert RMRequest("u7/3", [1], [2], group="u7").group == "u7"  # explicit: never parsed out of the uid
    assert RMRequest("solo", [1], [2]).group is None
