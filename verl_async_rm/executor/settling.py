"""How the executor resolves requests: results, cancellations, deadlines, lost slots, and failing who waits.

Mixed into :class:`~verl_async_rm.executor.core.PendingRequestExecutor`; it uses the executor's queue (``_room``),
slots (``_slots``), counters (``_stats``), event loop (``_loop``), ``policy``, ``_name`` and ``_maybe_wake``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_async_rm.errors import ExecutorClosedError, NoSlotsError, RequestTimeoutError, SlotLostError
from verl_async_rm.executor.request import BLOCKED, DONE, PENDING, RUNNING, Request

__all__ = ["SettlingMixin"]


class SettlingMixin:
    """Every request leaves through :meth:`_settle` (or :meth:`_cancel`), exactly once."""

    def _settle(self, req: Request, value: Any, exc: BaseException | None) -> None:
        """Resolve ``req`` once. The caller has already taken it out of the queue / overflow bookkeeping."""
        if req.state == DONE:
            return
        req.state = DONE
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        fut, stats = req.future, self._stats
        if fut.done():  # the caller cancelled; its handler will find the request DONE
            stats.cancelled += 1
            return
        stats.step_last_settle = self._loop.time() if self._loop is not None else None
        if exc is None:
            fut.set_result(value)
            stats.completed += 1
        else:
            fut.set_exception(exc)
            if isinstance(exc, RequestTimeoutError):
                stats.timed_out += 1
            else:
                stats.failed += 1

    def _unlink(self, req: Request) -> None:
        """Take a waiting request out of the room before settling it; blocked ones may take its place."""
        if req.state == PENDING or req.state == BLOCKED:
            self._room.remove(req)
            self._maybe_wake()

    def _cancel(self, req: Request) -> None:
        """The caller's ``submit`` was cancelled: drop the request (a running batch just loses its result)."""
        if req.state == DONE:
            return
        self._unlink(req)
        req.state = DONE
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        self._stats.cancelled += 1

    def _expire(self, req: Request) -> None:
        """Deadline timer: fail the request wherever it is."""
        if req.state == DONE:
            return
        req.timer = None
        where = {BLOCKED: "blocked on a full queue", PENDING: "waiting for a batch",
                 RUNNING: "in a running batch"}[req.state]
        self._unlink(req)
        self._settle(req, None, RequestTimeoutError(
            f"executor {self._name!r}: request #{req.seq} missed its deadline of {req.deadline_s:g} s while "
            f"{where} ({len(self._room)} pending, {len(self._slots.free)}/{len(self._slots)} slots free, "
            f"{self._slots.usable} usable)"
        ))

    def _requeue(self, batch: list[Request], exc: SlotLostError) -> None:
        """Put the unsettled requests of a batch whose slot was lost back at the head of the queue (or fail them)."""
        again = []
        for req in batch:
            if req.state != RUNNING:
                continue
            if self._closed:  # no loop will serve the queue again
                self._settle(req, None, ExecutorClosedError(
                    f"executor {self._name!r} was closed while the request's slot was lost ({exc})"))
            elif req.requeued >= self.policy.slot_retries:
                self._settle(req, None, exc)
            else:
                req.requeued += 1
                again.append(req)
        self._room.requeue(again)
        self._stats.requeued += len(again)

    def _on_slots_change(self) -> None:
        """A slot became free, or was lost for good: wake the loop; with no slot left, fail who waits."""
        if not self._slots.usable:
            self._fail_waiting(self._no_slots_error)
        self._notify()

    def _no_slots_error(self) -> NoSlotsError:
        return NoSlotsError(
            f"executor {self._name!r}: all {len(self._slots)} slot(s) (RM replicas) are lost and none could be "
            f"replaced ({self._slots.counts['lost']} lost, {self._slots.counts['replace_failed']} replacements "
            "failed); see the log for why each was lost"
        )

    def _fail_waiting(self, make_exc: Callable[[], BaseException]) -> None:
        """Fail every waiting (pending or blocked) request, each with its own exception instance."""
        for req in self._room.clear():
            self._settle(req, None, make_exc())
