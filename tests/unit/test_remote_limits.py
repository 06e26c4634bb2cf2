"""Job-wide limits of a remote RM: the token buckets (requests/min, tokens/min), the concurrency bound, first come
first served, deadlines, requests too large to ever fit, reconciliation with the reported usage, cancellation. Time is
virtual (``run_virtual``): every timing asserted is exact."""

from __future__ import annotations

import asyncio
import math

import pytest

from verl_async_rm.errors import RequestTimeoutError, TokenLimitError
from verl_async_rm.remote.limits import Limiter, RateLimits, TokenBucket
from verl_async_rm.testing.batcher import run_virtual

pytestmark = pytest.mark.unit


async def granted_at(limiter: Limiter, tokens: list[int], deadline: float = math.inf) -> list[float]:
    """Acquire one permit per entry, all at once; each one's grant time (the permits are kept)."""
    loop = asyncio.get_running_loop()

    async def one(n: int) -> float:
        await limiter.acquire(n, deadline)
        return loop.time()

    return list(await asyncio.gather(*(one(n) for n in tokens)))


def test_bucket_refills_at_its_rate_up_to_its_capacity_and_may_go_below_zero():
    bucket = TokenBucket(rate_per_s=10.0, capacity=50.0, now=0.0)
    assert bucket.level(0.0) == 50.0
    bucket.take(80, 0.0)
    assert bucket.level(0.0) == -30.0
    assert bucket.ready_at(20, 0.0) == pytest.approx(5.0)
    assert bucket.level(2.0) == pytest.approx(-10.0)
    assert bucket.level(100.0) == 50.0  # capped
    bucket.give(1000, 100.0)
    assert bucket.level(100.0) == 50.0
    assert bucket.ready_at(10, 100.0) == 100.0


def test_max_rpm_allows_one_seconds_burst_then_paces():
    async def main():
        limiter = Limiter(RateLimits(max_rpm=600))  # 10 per second, burst of 10
        return await granted_at(limiter, [0] * 12)

    times = run_virtual(main)
    assert times[:10] == [0.0] * 10
    assert times[10:] == pytest.approx([0.1, 0.2])


def test_max_rpm_under_sixty_still_lets_one_request_through():
    async def main():
        limiter = Limiter(RateLimits(max_rpm=30))  # one every 2 s; the burst is one request
        return await granted_at(limiter, [0, 0, 0])

    assert run_virtual(main) == pytest.approx([0.0, 2.0, 4.0])


def test_max_tpm_holds_a_minutes_worth_and_paces_the_rest():
    async def main():
        limiter = Limiter(RateLimits(max_tpm=6000))  # 100 tokens per second, burst of 6000
        return await granted_at(limiter, [5000, 2000, 100])

    # 1000 left after the first; the second needs 1000 more (10 s); the third 100 more (1 s)
    assert run_virtual(main) == pytest.approx([0.0, 10.0, 11.0])


def test_a_request_larger_than_max_tpm_fails_at_once():
    async def main():
        limiter = Limiter(RateLimits(max_tpm=1000))
        loop = asyncio.get_running_loop()
        with pytest.raises(TokenLimitError, match=r"1001 tokens.*max_tpm=1000"):
            await limiter.acquire(1001, loop.time() + 3600)
        assert loop.time() == 0.0
        assert limiter.stats()["too_large"] == 1
        await limiter.acquire(1000, loop.time() + 1)  # the largest that fits goes

    run_virtual(main)


def test_waiting_ends_at_the_deadline_with_a_timeout_and_never_later():
    async def main():
        limiter = Limiter(RateLimits(max_rpm=60))
        loop = asyncio.get_running_loop()
        await limiter.acquire(0, math.inf)
        with pytest.raises(RequestTimeoutError, match="rate limits.*max_rpm=60"):
            await limiter.acquire(0, 0.25)
        assert loop.time() == 0.25
        assert limiter.stats()["waiting"] == 0 and limiter.stats()["timed_out"] == 1
        with pytest.raises(RequestTimeoutError):  # a deadline already past: at once
            await limiter.acquire(0, 0.25)
        assert loop.time() == 0.25
        await limiter.acquire(0, math.inf)  # the next one still goes when the bucket allows
        assert loop.time() == 1.0

    run_virtual(main)


def test_concurrency_bound_and_first_come_first_served():
    async def main():
        limiter = Limiter(RateLimits(max_concurrency=2))
        loop = asyncio.get_running_loop()
        a = await limiter.acquire(1, math.inf)
        b = await limiter.acquire(1, math.inf)
        order: list[str] = []

        async def wait(name: str):
            permit = await limiter.acquire(1, math.inf)
            order.append(name)
            return permit

        c, d = asyncio.ensure_future(wait("c")), asyncio.ensure_future(wait("d"))
        await asyncio.sleep(1)
        assert order == [] and limiter.stats()["waiting"] == 2 and limiter.stats()["in_flight"] == 2
        a.release()
        await asyncio.sleep(0)
        assert order == ["c"]
        b.release()
        b.release()  # a second release is a no-op
        await asyncio.gather(c, d)
        assert order == ["c", "d"] and limiter.stats()["in_flight"] == 2
        assert loop.time() == 1.0

    run_virtual(main)


def test_a_large_request_at_the_head_is_not_overtaken_by_smaller_ones():
    async def main():
        limiter = Limiter(RateLimits(max_tpm=600))  # 10 per second
        return await granted_at(limiter, [500, 400, 10])  # the 10 fits at once but waits its turn

    assert run_virtual(main) == pytest.approx([0.0, 30.0, 31.0])


def test_release_reconciles_the_reservation_with_the_usage_reported():
    async def main():
        limiter = Limiter(RateLimits(max_tpm=6000))  # 100 tokens per second
        loop = asyncio.get_running_loop()
        available = lambda: limiter.stats()["tokens_available"]  # noqa: E731
        permit = await limiter.acquire(1000, math.inf)
        permit.release(400)  # used less than reserved: 600 credited
        assert available() == 5600 and limiter.stats()["tokens_credited"] == 600
        permit = await limiter.acquire(2000, math.inf)
        permit.release(6500)  # used more: 4500 debited, the bucket goes below zero
        assert available() == -900 and limiter.stats()["tokens_debited"] == 4500
        permit = await limiter.acquire(100, math.inf)  # waits for 1000 tokens: 10 s
        assert loop.time() == 10.0 and available() == 0
        permit.release(None)  # not known: the reservation stands
        assert available() == 0
        permit = await limiter.acquire(100, math.inf)
        assert loop.time() == 11.0
        permit.release(0)  # the server processed nothing: refunded
        assert available() == 100

    run_virtual(main)


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_moves_up():
    async def main():
        limiter = Limiter(RateLimits(max_concurrency=1))
        loop = asyncio.get_running_loop()
        first = await limiter.acquire(0, math.inf)
        blocked = asyncio.ensure_future(limiter.acquire(0, math.inf))
        later = asyncio.ensure_future(limiter.acquire(0, math.inf))
        await asyncio.sleep(0)
        blocked.cancel()
        await asyncio.sleep(0)
        first.release()
        (await later).release()
        assert blocked.cancelled()
        stats = limiter.stats()
        assert stats["in_flight"] == 0 and stats["waiting"] == 0 and stats["cancelled"] == 1
        assert loop.time() == 0.0

    run_virtual(main)


def test_a_permit_granted_as_its_caller_is_cancelled_is_given_back():
    async def main():
        limiter = Limiter(RateLimits(max_concurrency=1))
        first = await limiter.acquire(0, math.inf)
        waiter = asyncio.ensure_future(limiter.acquire(0, math.inf))
        await asyncio.sleep(0)
        first.release()  # grants the waiter's future...
        waiter.cancel()  # ...and its task is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert limiter.stats()["in_flight"] == 0
        (await limiter.acquire(0, 1.0)).release()

    run_virtual(main)


def test_no_limits_grant_at_once():
    async def main():
        limiter = Limiter()
        assert await granted_at(limiter, [10**9] * 100) == [0.0] * 100
        assert limiter.stats()["in_flight"] == 100 and limiter.stats()["waited"] == 0

    run_virtual(main)


def test_bad_token_counts_are_refused():
    async def main():
        with pytest.raises(ValueError, match="tokens"):
            await Limiter().acquire(-1, 1.0)

    run_virtual(main)


def test_a_bogus_usage_counts_at_most_four_times_the_reservation_and_a_non_count_is_ignored():
    """A usage of 10**9 tokens is debited 4x the reservation at most (debited whole, it would hold the bucket 10^9
    tokens below zero: days of waiting for every later request), and a usage that is not an integer >= 0 (a float, a
    bool, a negative number, text) leaves the reservation as it stands."""
    async def main():
        limiter = Limiter(RateLimits(max_tpm=6000))  # 100 tokens per second
        loop = asyncio.get_running_loop()
        available = lambda: limiter.stats()["tokens_available"]  # noqa: E731
        permit = await limiter.acquire(1000, math.inf)
        counted = permit.release(10**9)
        assert available() == 6000 - 4000 and limiter.stats()["tokens_debited"] == 3000
        assert counted == 4000  # 4 x the 1000 reserved
        assert permit.release(10**9) is None  # a second release does nothing
        permit = await limiter.acquire(3000, math.inf)  # 2000 available: waits 10 s for 1000 more, not days
        assert loop.time() == 10.0 and available() == 0
        for bogus in (1e9, 1.5, True, -5, "700"):  # not counts: the reservation stands
            assert permit.release(bogus) is None  # type: ignore[arg-type]
            assert available() == 0
            permit = await limiter.acquire(0, math.inf)
        stats = limiter.stats()
        assert (stats["tokens_debited"], stats["tokens_credited"], stats["in_flight"]) == (3000, 0, 1)

    run_virtual(main)
