"""Job-wide limits on what one process sends to a remote RM: requests/min and tokens/min token buckets and a bound on
requests in flight (pure asyncio, no threads; the RM service holds one :class:`Limiter` per RM, so they hold for the
whole job).

Bucket capacities, the burst allowed after an idle spell (both buckets start full):

- requests/min: one second's worth, at least one request. Providers enforce a per-minute request limit over shorter
  windows (OpenAI: "60,000 requests/minute may be enforced as 1,000 requests/second"), so a minute's worth sent at
  the start of a step would come back as 429s; smoothing requests costs nothing when each one is small.
- tokens/min: a minute's worth. One request holds thousands of tokens (its prompt plus its max output tokens): with one
  second's worth (verl's ``rate_limited`` manager) a 2,000-token request under 100k tokens/min (1,667 per second) could
  only be sent by running into debt. A request larger than a minute's worth is one the provider itself refuses
  ("Request too large"), which makes it the natural bound for failing at once (:class:`TokenLimitError`). The burst is
  paced by the request bucket anyway.

A request reserves what it really sends plus its max output tokens before it is sent; :meth:`Permit.release`
reconciles the reservation with the usage the server reports (the bucket may go below zero: later requests wait
longer). A usage counts at most :data:`USAGE_CAP` times the reservation, and one that is not a count (a float, a bool,
a negative number) is ignored: one bogus count must not stall the job. Waiters are served first come, first served,
each until its deadline at most."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from verl_async_rm.errors import RequestTimeoutError, TokenLimitError

__all__ = ["RateLimits", "TokenBucket", "Limiter", "Permit", "USAGE_CAP"]

logger = logging.getLogger(__name__)

#: A timer may fire up to one clock tick early: a bucket this close to ready counts as ready.
_CLOCK_RESOLUTION = time.get_clock_info("monotonic").resolution
#: A reported usage counts at most this many times the request's reservation (its estimate): a real count is near the
#: estimate, while one bogus count (10^9 prompt tokens) would hold the tokens/min bucket below zero for days.
USAGE_CAP = 4


@dataclass(frozen=True)
class RateLimits:
    """Job-wide limits of one remote RM (None: no limit), checked as the RM's settings (``RMConfig.max_concurrency``,
    ``max_rpm``, ``max_tpm``): requests in flight, requests per minute (every attempt counts), tokens per minute
    (prompt plus max output tokens reserved, reconciled with the usage the server reports)."""

    max_concurrency: int | None = None
    max_rpm: float | None = None
    max_tpm: float | None = None


class TokenBucket:
    """``capacity`` tokens refilled at ``rate_per_s``; starts full. Its level may go below zero (a debit after the
    fact), never above ``capacity``."""

    __slots__ = ("rate_per_s", "capacity", "_level", "_t")

    def __init__(self, rate_per_s: float, capacity: float, now: float) -> None:
        if not rate_per_s > 0 or not capacity > 0:
            raise ValueError(f"a token bucket needs a positive rate and capacity, got {rate_per_s!r}, {capacity!r}")
        self.rate_per_s, self.capacity = rate_per_s, capacity
        self._level, self._t = capacity, now

    def level(self, now: float) -> float:
        """Tokens available at ``now`` (not before the last change)."""
        if now > self._t:
            self._level = min(self.capacity, self._level + (now - self._t) * self.rate_per_s)
            self._t = now
        return self._level

    def ready_at(self, n: float, now: float) -> float:
        """The earliest time at which ``n`` tokens are available (``now`` when they are)."""
        missing = n - self.level(now)
        return now if missing <= 0 else now + missing / self.rate_per_s

    def take(self, n: float, now: float) -> None:
        self._level = self.level(now) - n

    def give(self, n: float, now: float) -> None:
        self._level = min(self.capacity, self.level(now) + n)


class Permit:
    """What one request holds while it is sent: a concurrency slot and ``tokens`` reserved."""

    __slots__ = ("tokens", "_limiter", "_released")

    def __init__(self, limiter: Limiter, tokens: int) -> None:
        self.tokens, self._limiter, self._released = tokens, limiter, False

    def release(self, used_tokens: int | None = None) -> int | None:
        """Give the concurrency slot back and reconcile the reservation (once; later calls do nothing).
        ``used_tokens``: the server's count (prompt plus completion: the difference is debited or credited); 0 when
        the server processed nothing (a 429, a refused connection); None to keep the reservation (not known). Returns
        the tokens counted: ``used_tokens``, at most :data:`USAGE_CAP` times the reservation; None when the
        reservation stands (no count, one that is not an integer >= 0, or a second call)."""
        if self._released:
            return None
        self._released = True
        return self._limiter._release(self, used_tokens)

    def __enter__(self) -> Permit:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclass
class _Waiter:
    tokens: int
    future: asyncio.Future
    timer: asyncio.TimerHandle | None = None


class Limiter:
    """Grants :class:`Permit` s under :class:`RateLimits`, first come first served; binds to the event loop of its
    first :meth:`acquire` and reads that loop's clock (a virtual-time loop makes tests exact)."""

    def __init__(self, limits: RateLimits | None = None) -> None:
        self.limits = limits or RateLimits()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests: TokenBucket | None = None
        self._tokens: TokenBucket | None = None
        self._waiters: deque[_Waiter] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._in_flight = 0
        self._counts = dict(granted=0, waited=0, timed_out=0, cancelled=0, too_large=0)
        self._waited_s = 0.0
        self._tokens_reserved = self._tokens_debited = self._tokens_credited = 0

    def check_tokens(self, tokens: int) -> None:
        """Raise :class:`TokenLimitError` when a request of ``tokens`` can never be sent under tokens/min."""
        limit = self.limits.max_tpm
        if limit is not None and tokens > limit:
            self._counts["too_large"] += 1
            raise TokenLimitError(
                f"a request of {tokens} tokens (what it sends plus its max output tokens) exceeds max_tpm="
                f"{limit:g}, the most one minute can hold: it could never be sent. Shorten the input, lower the max "
                "output tokens or raise max_tpm")

    async def acquire(self, tokens: int, deadline: float) -> Permit:
        """A permit for one request of ``tokens`` (prompt plus max output tokens), granted once a concurrency slot and
        both buckets allow it and every earlier waiter is served. ``deadline``: the request's deadline on the loop's
        clock (``math.inf``: none); raises :class:`RequestTimeoutError` then, never later, and
        :class:`TokenLimitError` at once when the request is larger than tokens/min allows."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be an integer >= 0, got {tokens!r}")
        self.check_tokens(tokens)
        loop = self._bind()
        now = loop.time()
        if not self._waiters and self._ready_at(tokens, now) <= now + _CLOCK_RESOLUTION:
            return self._grant(tokens, now)
        if deadline <= now:
            self._counts["timed_out"] += 1
            raise self._timeout_error(tokens, 0.0)
        waiter = _Waiter(tokens, loop.create_future())
        if deadline != math.inf:
            waiter.timer = loop.call_at(deadline, self._expire, waiter, now)
        self._waiters.append(waiter)
        self._counts["waited"] += 1
        self._pump()
        try:
            permit = await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                waiter.future.result().release(0)  # granted as the caller was cancelled: nothing was sent
            else:
                self._drop(waiter)
            self._counts["cancelled"] += 1
            raise
        finally:
            if waiter.timer is not None:
                waiter.timer.cancel()
        self._waited_s += loop.time() - now
        return permit

    def stats(self) -> dict[str, Any]:
        """Counters (granted, waited, timed_out, cancelled, too_large), time spent waiting, requests in flight and
        waiting, bucket levels now, and tokens reserved, debited and credited by reconciliation."""
        now = self._loop.time() if self._loop is not None else None
        return {**self._counts, "waited_s": self._waited_s, "in_flight": self._in_flight,
                "waiting": len(self._waiters),
                "requests_available": None if self._requests is None or now is None else self._requests.level(now),
                "tokens_available": None if self._tokens is None or now is None else self._tokens.level(now),
                "tokens_reserved": self._tokens_reserved, "tokens_debited": self._tokens_debited,
                "tokens_credited": self._tokens_credited}

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            now = loop.time()
            if (rpm := self.limits.max_rpm) is not None:
                self._requests = TokenBucket(rpm / 60.0, max(1.0, rpm / 60.0), now)
            if (tpm := self.limits.max_tpm) is not None:
                self._tokens = TokenBucket(tpm / 60.0, tpm, now)
        elif self._loop is not loop:
            raise RuntimeError("this Limiter is bound to another event loop; use one limiter per loop")
        return loop

    def _ready_at(self, tokens: int, now: float) -> float:
        """When a request of ``tokens`` could go, concurrency aside (math.inf: no slot free)."""
        if self.limits.max_concurrency is not None and self._in_flight >= self.limits.max_concurrency:
            return math.inf
        ready = now
        if self._requests is not None:
            ready = max(ready, self._requests.ready_at(1, now))
        if self._tokens is not None:
            ready = max(ready, self._tokens.ready_at(tokens, now))
        return ready

    def _grant(self, tokens: int, now: float) -> Permit:
        if self._requests is not None:
            self._requests.take(1, now)
        if self._tokens is not None:
            self._tokens.take(tokens, now)
        self._in_flight += 1
        self._counts["granted"] += 1
        self._tokens_reserved += tokens
        return Permit(self, tokens)

    def _pump(self) -> None:
        """Grant the head waiters that can go now; wake up when the next one can (a release also wakes it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():  # expired or cancelled, not yet removed
                self._waiters.popleft()
                continue
            ready = self._ready_at(waiter.tokens, now)
            if ready > now + _CLOCK_RESOLUTION:
                if ready != math.inf:
                    self._timer = loop.call_at(ready, self._pump)
                return
            self._waiters.popleft()
            waiter.future.set_result(self._grant(waiter.tokens, now))

    def _release(self, permit: Permit, used_tokens: int | None) -> int | None:
        self._in_flight -= 1
        counted = None
        if not isinstance(used_tokens, bool) and isinstance(used_tokens, int) and used_tokens >= 0:
            counted = min(used_tokens, USAGE_CAP * permit.tokens)
        if counted is not None and self._tokens is not None:
            now = self._loop.time()  # type: ignore[union-attr]
            diff = counted - permit.tokens
            if diff > 0:
                self._tokens.take(diff, now)
                self._tokens_debited += diff
            elif diff < 0:
                self._tokens.give(-diff, now)
                self._tokens_credited += -diff
        if self._waiters:
            self._pump()
        return counted

    def _expire(self, waiter: _Waiter, t0: float) -> None:
        """The waiter's deadline passed before its permit was granted."""
        waiter.timer = None
        if waiter.future.done():
            return
        self._counts["timed_out"] += 1
        waiter.future.set_exception(self._timeout_error(waiter.tokens, self._loop.time() - t0))  # type: ignore
        self._drop(waiter)

    def _drop(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        if self._waiters:
            self._pump()  # the head may have changed

    def _timeout_error(self, tokens: int, waited_s: float) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"the request's deadline passed after {waited_s:.3g} s waiting for the rate limits ({self._describe()}; "
            f"the request needs {tokens} tokens, {len(self._waiters)} requests waited, {self._in_flight} in flight)")

    def _describe(self) -> str:
        limits = self.limits
        parts = [f"max_concurrency={limits.max_concurrency}" if limits.max_concurrency is not None else "",
                 f"max_rpm={limits.max_rpm:g}" if limits.max_rpm is not None else "",
                 f"max_tpm={limits.max_tpm:g}" if limits.max_tpm is not None else ""]
        return ", ".join(p for p in parts if p) or "no limits"
