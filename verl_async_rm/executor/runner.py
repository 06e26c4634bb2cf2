"""Running one batch on one slot: call ``batch_fn``, check its answer, isolate failing items, settle every request.

``batch_fn(items, slot)`` must be async and return one entry per item, in order: a result, or an ``Exception``
instance that fails only that item. If it raises, every item of the call fails with that exception, unless bisection
is on: the batch is then split in halves and retried to find the item(s) that make it raise, within a budget of
``2 * ceil(log2(len(batch)))`` extra calls (enough to isolate one bad item anywhere in the batch).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

from verl_async_rm.errors import BatchResultError, RequestTimeoutError, SlotError, SlotLostError, take_slot_ready
from verl_async_rm.executor.request import DONE, Request
from verl_async_rm.executor.stats import ExecutorStats

__all__ = ["BatchRunner", "SlotVerdict", "bisect_budget"]

logger = logging.getLogger(__name__)

#: settle(request, value, exc): resolve a request once (a no-op if it is already DONE).
Settle = Callable[[Request, Any, "BaseException | None"], None]


def bisect_budget(batch_size: int) -> int:
    """Extra ``batch_fn`` calls allowed to isolate failing items in a batch of ``batch_size`` that raised."""
    return 2 * math.ceil(math.log2(batch_size)) if batch_size > 1 else 0


class _BatchTimedOut(Exception):
    """Internal: the batch_fn call ran past ``batch_timeout_s``."""


class SlotVerdict:
    """What a batch's end says about its slot: ``lost`` (the error; the unsettled requests are for the executor to
    re-queue) or ``busy_until`` (an awaitable: the slot still runs the given-up call). Neither: the slot is fine."""

    __slots__ = ("lost", "busy_until")

    def __init__(self, lost: SlotLostError | None = None, busy_until: Any = None) -> None:
        self.lost = lost
        self.busy_until = busy_until


_SLOT_OK = SlotVerdict()


class BatchRunner:
    """Runs batches for one executor; holds no per-batch state, so one runner serves every slot at once."""

    def __init__(
        self,
        batch_fn: Callable[[list[Any], Any], Any],
        *,
        stats: ExecutorStats,
        settle: Settle,
        bisect_on_error: bool,
        batch_timeout_s: float | None,
        name: str,
    ) -> None:
        self._batch_fn = batch_fn
        self._stats = stats
        self._settle = settle
        self._bisect_on_error = bisect_on_error
        self._batch_timeout_s = batch_timeout_s
        self._name = name

    async def run(self, reqs: list[Request], slot: Any) -> SlotVerdict:
        """Run ``reqs`` on ``slot`` and settle each of them (result, per-item exception or the batch's exception).

        A :class:`SlotLostError` (raised at once or during bisection) leaves the unsettled requests to the caller,
        with the verdict ``lost``; a :class:`SlotError` carrying ``slot_ready`` gives the verdict ``busy_until``.
        """
        try:
            results = await self._call(reqs, slot)
        except _BatchTimedOut:
            self._fail(reqs, self._timeout_error(len(reqs), slot))
            return _SLOT_OK
        except SlotLostError as exc:
            take_slot_ready(exc)
            return SlotVerdict(lost=exc)
        except Exception as exc:  # noqa: BLE001 - any failure of user code fails (or bisects) the batch
            ready = take_slot_ready(exc)
            # A contract breach, a timeout or a failed slot is not an item's fault: halves would fail the same way.
            if self._bisect_on_error and len(reqs) > 1 and not isinstance(
                exc, (BatchResultError, RequestTimeoutError, SlotError)
            ):
                logger.warning(
                    "executor %r: batch_fn raised %s on a batch of %d (slot %r); bisecting to isolate the failing "
                    "item(s)", self._name, type(exc).__name__, len(reqs), slot,
                )
                try:
                    await self._bisect(reqs, exc, slot, [bisect_budget(len(reqs))])
                except SlotError as slot_exc:  # the slot itself failed while bisecting
                    ready = take_slot_ready(slot_exc)
                    if isinstance(slot_exc, SlotLostError):
                        return SlotVerdict(lost=slot_exc)
                    self._fail(reqs, slot_exc)
            else:
                logger.warning("executor %r: batch_fn raised %s on a batch of %d (slot %r): %s",
                               self._name, type(exc).__name__, len(reqs), slot, exc)
                self._fail(reqs, exc)
            return SlotVerdict(busy_until=ready) if ready is not None else _SLOT_OK
        self._deliver(reqs, results)
        return _SLOT_OK

    async def _call(self, reqs: list[Request], slot: Any) -> Any:
        """One ``batch_fn`` call on the items of ``reqs``; raises what it raises, or ``_BatchTimedOut``."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            awaitable = self._batch_fn([r.item for r in reqs], slot)
            if not inspect.isawaitable(awaitable):
                raise BatchResultError(
                    f"batch_fn returned {type(awaitable).__name__}, not an awaitable; it must be an async callable "
                    "`async def batch_fn(items, slot) -> list` (a blocking function would stall every caller)"
                )
            if self._batch_timeout_s is None:
                try:
                    return await awaitable
                except asyncio.CancelledError:
                    if _being_cancelled():
                        raise
                    raise BatchResultError("batch_fn raised CancelledError although nothing cancelled the batch")
            task = asyncio.ensure_future(awaitable)
            try:
                done, _ = await asyncio.wait({task}, timeout=self._batch_timeout_s)
            except asyncio.CancelledError:
                task.cancel()  # the executor is closing: stop the call too
                task.add_done_callback(_retrieve)
                raise
            if not done:
                task.cancel()
                task.add_done_callback(_retrieve)  # do not wait: a batch_fn that ignores cancellation must not hang us
                raise _BatchTimedOut()
            if task.cancelled():
                raise BatchResultError("batch_fn raised CancelledError although nothing cancelled the batch")
            return task.result()
        finally:
            self._stats.exec_s.add(loop.time() - t0)

    def _deliver(self, reqs: list[Request], results: Any) -> None:
        """Settle each request with its entry of ``results``; a malformed answer fails the whole call."""
        if not isinstance(results, (list, tuple)) or len(results) != len(reqs):
            got = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
            self._fail(reqs, BatchResultError(
                f"batch_fn returned {got} for a batch of {len(reqs)} items; it must return a list with one entry "
                "per item, in order (a result, or an Exception instance to fail only that item)"
            ))
            return
        settle = self._settle
        for req, value in zip(reqs, results):
            if req.state != DONE:
                if isinstance(value, Exception):
                    settle(req, None, value)
                else:
                    settle(req, value, None)

    def _fail(self, reqs: list[Request], exc: BaseException) -> None:
        for req in reqs:
            self._settle(req, None, exc)

    async def _bisect(self, reqs: list[Request], exc: Exception, slot: Any, budget: list[int]) -> None:
        """Settle ``reqs``, a group presumed to make ``batch_fn`` raise ``exc``, spending at most ``budget[0]`` calls.

        Run the left half. If it succeeds, the right half is presumed to hold the culprit and is bisected without
        being run. If it fails, bisect it, then run the right half (which may fail too). A single item presumed
        failing is failed with the exception of the smallest call that contained it, without a call of its own.
        """
        reqs = [r for r in reqs if r.state != DONE]  # callers that gave up need no more calls
        if len(reqs) <= 1 or budget[0] <= 0:
            self._fail(reqs, exc)
            return
        mid = len(reqs) // 2
        left, right = reqs[:mid], reqs[mid:]
        left_exc = await self._try(left, slot, budget)
        if left_exc is None:
            await self._bisect(right, exc, slot, budget)
            return
        await self._bisect(left, left_exc, slot, budget)
        right = [r for r in right if r.state != DONE]
        if not right:
            return
        if budget[0] <= 0:
            self._fail(right, exc)
            return
        right_exc = await self._try(right, slot, budget)
        if right_exc is not None:
            await self._bisect(right, right_exc, slot, budget)

    async def _try(self, reqs: list[Request], slot: Any, budget: list[int]) -> Exception | None:
        """One bisection call: deliver and return None on success, return the exception if it raised."""
        budget[0] -= 1
        self._stats.bisect_calls += 1
        try:
            results = await self._call(reqs, slot)
        except _BatchTimedOut:
            self._fail(reqs, self._timeout_error(len(reqs), slot))
            return None
        except BatchResultError as exc:
            self._fail(reqs, exc)
            return None
        except SlotError:
            raise  # not an item's fault: run() decides for the whole batch
        except Exception as exc:  # noqa: BLE001
            return exc
        self._deliver(reqs, results)
        return None

    def _timeout_error(self, size: int, slot: Any) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"executor {self._name!r}: batch_fn ran longer than batch_timeout_s={self._batch_timeout_s:g} s on a "
            f"batch of {size} (slot {slot!r}); the call was cancelled. Raise BatchPolicy.batch_timeout_s if the RM "
            "is just slow"
        )


def _being_cancelled() -> bool:
    """Whether the current task has a cancellation request (always assumed on Python 3.10, which cannot tell)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is None or cancelling() > 0


def _retrieve(task: asyncio.Future) -> None:
    """Consume the outcome of an abandoned batch_fn call so asyncio does not log it as never retrieved."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("abandoned batch_fn call ended with %r", task.exception())
