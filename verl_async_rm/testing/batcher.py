"""Test doubles for code that uses the batcher: a gated batch function and a virtual-time event loop.

``GatedBatchFn`` records every call and holds it until the test opens the gate, so tests observe "not done yet"
and then release, with no sleeps. ``run_virtual`` runs a coroutine on an event loop whose clock jumps straight to the
next timer whenever nothing is ready: ``max_wait_ms``, deadlines and ``asyncio.sleep`` then take no real time, and
timings are exact and deterministic. The virtual loop relies on CPython's ``BaseEventLoop`` internals; use it in tests
only, and only for code that does no real I/O.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["GatedBatchFn", "VirtualClockLoop", "VirtualLoopDeadlock", "run_virtual"]

T = TypeVar("T")


class VirtualLoopDeadlock(RuntimeError):
    """Raised when the virtual loop has nothing ready and nothing scheduled: everything left waits forever."""


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` only moves when every task is waiting, and then straight to the next timer."""

    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self) -> None:
        scheduled = self._scheduled  # type: ignore[attr-defined]
        while scheduled and scheduled[0]._cancelled:
            handle = heapq.heappop(scheduled)
            handle._scheduled = False
            self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
        if not self._ready and not self._stopping:  # type: ignore[attr-defined]
            if not scheduled:
                raise VirtualLoopDeadlock("every task is waiting and no timer is scheduled: the code under test hangs")
            self._virtual_now = max(self._virtual_now, scheduled[0]._when)
        super()._run_once()  # type: ignore[misc]


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]] | Coroutine[Any, Any, T], *, timeout_s: float = 1e6) -> T:
    """Run ``main`` on a fresh :class:`VirtualClockLoop`; ``timeout_s`` (virtual seconds) is a hang detector."""
    coro = main() if callable(main) else main
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(asyncio.wait_for(coro, timeout_s))
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                # bounded: a task that swallows cancellation must not keep the test running (virtual seconds)
                loop.run_until_complete(asyncio.wait(pending, timeout=3600.0))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


class GatedBatchFn:
    """``async (items, replica, deadline) -> list`` that records its calls and waits at a gate before answering.

    Args:
        fn: turns one item into its entry of the result list (a value, or an ``Exception`` instance); default: the
            item itself.
        open: start with the gate open (calls answer at once).
        raise_if: if it returns an exception for the items of a call, the call raises it (after the gate).
        delay_s: ``asyncio.sleep`` this long inside each call (for virtual-time tests).
    """

    def __init__(
        self,
        fn: Callable[[Any], Any] | None = None,
        *,
        open: bool = False,  # noqa: A002 - reads well at the call site
        raise_if: Callable[[list[Any]], BaseException | None] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.fn = fn or (lambda item: item)
        self.raise_if = raise_if
        self.delay_s = delay_s
        self.calls: list[tuple[list[Any], Any]] = []
        self.active = 0
        self.max_active = 0
        self._open = open
        self._gate: asyncio.Event | None = None
        self._changed: asyncio.Condition | None = None

    async def __call__(self, items: list[Any], replica: Any, deadline: float) -> list[Any]:
        self._bind()
        assert self._gate is not None and self._changed is not None
        self.calls.append((list(items), replica))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        async with self._changed:
            self._changed.notify_all()
        try:
            await self._gate.wait()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.raise_if is not None:
                exc = self.raise_if(items)
                if exc is not None:
                    raise exc
            return [self.fn(item) for item in items]
        finally:
            self.active -= 1

    def open(self) -> None:
        """Let every waiting and future call answer."""
        self._bind()
        assert self._gate is not None
        self._gate.set()

    def close(self) -> None:
        """Hold future calls at the gate again."""
        self._bind()
        assert self._gate is not None
        self._gate.clear()

    async def wait_calls(self, n: int) -> None:
        """Return once at least ``n`` calls have started."""
        self._bind()
        assert self._changed is not None
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.calls) >= n)

    @property
    def batch_sizes(self) -> list[int]:
        return [len(items) for items, _ in self.calls]

    @property
    def seen(self) -> list[Any]:
        """Every item passed to any call, in call order (repeats when a batch was re-queued after a lost replica)."""
        return [item for items, _ in self.calls for item in items]

    def _bind(self) -> None:
        if self._gate is None:  # created lazily, inside the running loop
            self._gate = asyncio.Event()
            self._changed = asyncio.Condition()
            if self._open:
                self._gate.set()
