"""``BatchRunner``: the batches in flight, each one ``batch_fn`` call on one slot (its own task), under
``batch_timeout_s`` (a timer on that task).

The contract of ``async batch_fn(items, slot)``: one entry per item, in order: a result, or an ``Exception`` instance
that fails only that item. Anything else it returns fails every request with :class:`BatchResultError`; what it
raises fails every request, except :class:`SlotLostError`, which re-queues them and loses the slot. Past
``batch_timeout_s`` every request fails at once with :class:`RequestTimeoutError`, the call is cancelled and the slot
stays ``late`` until the call has really ended.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any

from verl_async_rm.batching.request import Request
from verl_async_rm.batching.slots import SlotTable
from verl_async_rm.batching.stats import ExecutorStats
from verl_async_rm.errors import (
    BatchResultError,
    ExecutorClosedError,
    ExecutorCrashedError,
    RequestTimeoutError,
    SlotLostError,
)

__all__ = ["BatchRunner"]

logger = logging.getLogger(__name__)


class BatchRunner:
    """Runs each batch as its own task on the slot it was given, and settles every request of it through the
    executor's ``settle(request, value, exc)`` (once) or ``requeue(requests, exc)`` (its slot was lost)."""

    def __init__(
        self,
        batch_fn: Callable[[list[Any], Any], Any],
        slots: SlotTable,
        stats: ExecutorStats,
        *,
        settle: Callable[[Request, Any, BaseException | None], None],
        requeue: Callable[[list[Request], SlotLostError], None],
        timeout_s: float | None,
        name: str,
    ) -> None:
        self._batch_fn = batch_fn
        self._slots = slots
        self._stats = stats
        self._settle = settle
        self._requeue = requeue
        self._timeout_s = timeout_s
        self._name = name
        self.running: dict[asyncio.Task, list[Request]] = {}  # batch task -> its requests
        self._closing = False  # set when aclose cancels the batches still running

    def start(self, batch: list[Request]) -> None:
        """Run ``batch`` on the oldest free slot (there must be one)."""
        task = asyncio.get_running_loop().create_task(self._run(batch, self._slots.free[0]))
        self._slots.take()  # that slot, taken once its task exists (creating it may fail)
        self.running[task] = batch
        task.add_done_callback(self._batch_done)

    async def aclose(self, grace_s: float) -> None:
        """Give running batches ``grace_s`` to finish, then cancel them: their requests fail with
        ``ExecutorClosedError`` (within a second even if ``batch_fn`` ignores the cancellation)."""
        running = set(self.running)
        if running and grace_s > 0:
            _, running = await asyncio.wait(running, timeout=grace_s)
        if not running:
            return
        self._closing = True
        for task in running:
            task.cancel()
        await asyncio.wait(running, timeout=1.0)
        for task in running:
            for req in self.running.get(task, ()):
                self._settle(req, None, self._closed_error())

    async def _run(self, batch: list[Request], index: int) -> None:
        lost: SlotLostError | None = None
        try:
            lost = await self._call(batch, index)
        except asyncio.CancelledError:  # the executor is closing and gave up on the batch
            for req in batch:
                self._settle(req, None, self._closed_error())
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must not strand callers
            logger.error("executor %r: running a batch failed unexpectedly", self._name, exc_info=exc)
            for req in batch:
                self._settle(req, None, ExecutorCrashedError.from_cause(self._name, exc))
        finally:
            if lost is None:
                self._slots.release(index)
            else:
                self._slots.lose(index, lost)

    async def _call(self, batch: list[Request], index: int) -> SlotLostError | None:
        """Call ``batch_fn`` on slot ``index`` and settle the batch; returns the error if it says the slot is lost.
        Re-raises ``CancelledError`` only when the executor is closing."""
        loop = asyncio.get_running_loop()
        slot = self._slots.slots[index]
        timer = None
        if self._timeout_s is not None:
            timer = loop.call_later(self._timeout_s, self._time_out, asyncio.current_task(), batch, index)
        t0 = loop.time()
        results: Any = None
        exc: BaseException | None = None
        try:
            awaitable = self._batch_fn([req.item for req in batch], slot)
            if not inspect.isawaitable(awaitable):
                raise BatchResultError(
                    f"batch_fn returned {type(awaitable).__name__}, not an awaitable; it must be an async callable "
                    "`async def batch_fn(items, slot) -> list` (a blocking function would stall every caller)"
                )
            results = await awaitable
        except asyncio.CancelledError:
            if self._closing:
                raise
            if self._slots.state[index] != "late":  # not cancelled by us: batch_fn raised it by itself
                exc = BatchResultError("batch_fn raised CancelledError although nothing cancelled the batch")
        except Exception as err:  # noqa: BLE001 - whatever batch_fn raises is the batch's outcome
            exc = err
        finally:
            if timer is not None:
                timer.cancel()
        if self._slots.state[index] == "late":  # timed out: its requests have failed already
            logger.info("executor %r: the timed-out call on slot %d has ended%s", self._name, index,
                        "" if exc is None else f" with {exc!r}")
            return exc if isinstance(exc, SlotLostError) else None
        self._stats.exec_s.add(loop.time() - t0)
        if exc is None:
            if isinstance(results, (list, tuple)) and len(results) == len(batch):
                settle = self._settle
                for req, value in zip(batch, results):
                    if isinstance(value, Exception):
                        settle(req, None, value)
                    else:
                        settle(req, value, None)
                return None
            got = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
            exc = BatchResultError(
                f"batch_fn returned {got} for a batch of {len(batch)} items; it must return a list with one entry "
                "per item, in order (a result, or an Exception instance to fail only that item)"
            )
        if isinstance(exc, SlotLostError):
            self._requeue(batch, exc)
            return exc
        logger.warning("executor %r: batch_fn failed on a batch of %d (slot %r): %s: %s", self._name, len(batch),
                       slot, type(exc).__name__, exc)
        for req in batch:
            self._settle(req, None, exc)
        return None

    def _time_out(self, task: asyncio.Task, batch: list[Request], index: int) -> None:
        """Timer of ``batch_timeout_s``: fail the batch now, cancel its call, and keep the slot ``late`` (no batch)
        until the call has really ended."""
        self._stats.exec_s.add(self._timeout_s)  # type: ignore[arg-type]
        error = RequestTimeoutError(
            f"executor {self._name!r}: a batch of {len(batch)} ran longer than batch_timeout_s="
            f"{self._timeout_s:g} s on slot {index} ({self._slots.slots[index]!r}); the call was cancelled and the "
            "slot takes no new batch until it has ended. Raise BatchPolicy.batch_timeout_s if the RM is just slow"
        )
        for req in batch:
            self._settle(req, None, error)
        self._slots.mark_late(index)
        task.cancel()

    def _closed_error(self) -> ExecutorClosedError:
        return ExecutorClosedError(f"executor {self._name!r} was closed while the request's batch was running")

    def _batch_done(self, task: asyncio.Task) -> None:
        self.running.pop(task, None)
        if not task.cancelled() and task.exception() is not None:  # _run settles everything; log regardless
            logger.error("executor %r: batch task failed", self._name, exc_info=task.exception())
