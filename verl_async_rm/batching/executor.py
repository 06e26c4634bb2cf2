"""``PendingRequestExecutor``: slot-based dynamic batching in pure asyncio (no Ray, no threads).

A supervised background loop sleeps on one ``asyncio.Event``, set whenever the queue or the slots change and at the
time the flush rule names (:meth:`WaitingRoom.next_flush`); when a slot is free and the rule says "now", it hands a
batch to the :class:`BatchRunner`. Every request leaves through ``_settle`` exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

from verl_async_rm.batching.batch_runner import BatchRunner
from verl_async_rm.batching.request import BLOCKED, DONE, PENDING, RUNNING, Request, check_tokens, normalise_slots
from verl_async_rm.batching.policy import BatchPolicy
from verl_async_rm.batching.waiting_room import WaitingRoom
from verl_async_rm.batching.slots import ReplaceFn, SlotTable
from verl_async_rm.batching.stats import ExecutorStats, StepStats
from verl_async_rm.errors import (
    ExecutorClosedError,
    ExecutorCrashedError,
    NoSlotsError,
    QueueFullError,
    RequestTimeoutError,
    SlotLostError,
)

__all__ = ["PendingRequestExecutor", "BatchFn"]

logger = logging.getLogger(__name__)

#: ``async batch_fn(items, slot) -> list``: one result or ``Exception`` instance per item, in order.
BatchFn = Callable[[list[Any], Any], Awaitable[list[Any]]]


class PendingRequestExecutor:
    """Collect single requests into batches and run them, through ``batch_fn`` (its contract:
    :mod:`~verl_async_rm.batching.batch_runner`), on free ``slots``: an int N (``0..N-1``) or slot objects (e.g. the RM
    replicas' handles). ``replace_slot(slot, index) -> new slot`` replaces a lost slot (else it is retired; with none
    left, requests fail with :class:`NoSlotsError`). Binds to the event loop of its first ``submit``."""

    def __init__(
        self,
        batch_fn: BatchFn,
        policy: BatchPolicy | Mapping[str, Any] | None = None,
        *,
        slots: int | Sequence[Any] = 1,
        name: str = "executor",
        replace_slot: ReplaceFn | None = None,
    ) -> None:
        if not callable(batch_fn):
            raise TypeError(f"batch_fn must be an async callable `(items, slot) -> list`, got {batch_fn!r}")
        self.policy = BatchPolicy.from_mapping(policy)
        self._name = name
        self._stats = ExecutorStats(self.policy.max_batch_size)
        self._room = WaitingRoom(self.policy)
        self._slots = SlotTable(normalise_slots(slots), replace=replace_slot, on_change=self._on_slots_change,
                                name=name)
        self._runner = BatchRunner(batch_fn, self._slots, self._stats, settle=self._settle, requeue=self._requeue,
                                   timeout_s=self.policy.batch_timeout_s, name=name)
        self._changed = asyncio.Event()  # set whenever the queue or the slots change: the loop sleeps on it
        self._seq = 0
        self._expect_n: int | None = None
        self._step_count = 0  # submits since the last drain (the current step)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._supervisor: asyncio.Task | None = None
        self._crash_streak = 0
        self._closed = False
        self._held = False  # hold(): no new batch until resume()

    # ------------------------------------------------------------------ public API

    async def submit(
        self, item: Any, *, num_tokens: int | None = None, deadline_s: float | None = None, group: Any = None
    ) -> Any:
        """Queue ``item`` and return its result, or raise its exception (``batch_fn``'s, or one of the executor's
        errors: queue full, closed, crashed loop, no slots, deadline or ``batch_timeout_s`` passed, broken contract).

        Args:
            num_tokens: the item's length; required when ``max_batch_tokens`` is set, used for length grouping.
            deadline_s: seconds from now, waiting or running; None: ``BatchPolicy.default_deadline_s``; ``math.inf``:
                none.
            group: a hashable key shared by siblings (GRPO responses to one prompt), for ``prefer_siblings``; None:
                the item's ``group`` attribute, if it has one (``RMRequest.group``).
        """
        if self._closed:
            self._stats.rejected += 1
            raise ExecutorClosedError(f"executor {self._name!r} is closed; it accepts no new requests")
        if not self._slots.usable:
            self._stats.rejected += 1
            raise self._no_slots_error()
        if num_tokens is not None:
            num_tokens = check_tokens(num_tokens)
        elif self.policy.max_batch_tokens is not None:
            raise ValueError(
                f"submit(num_tokens=None) but BatchPolicy.max_batch_tokens={self.policy.max_batch_tokens}: pass the "
                "item's length as num_tokens, or set max_batch_tokens=None"
            )
        if deadline_s is None:
            deadline_s = self.policy.default_deadline_s
        elif not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 seconds (math.inf for none), got {deadline_s!r}")
        supervisor = self._supervisor
        if supervisor is None or supervisor.done():
            self._start()
        room = self._room
        blocked = room.full()
        if blocked and self.policy.overflow == "reject":
            self._stats.rejected += 1
            raise QueueFullError(
                f"executor {self._name!r}: {len(room)} requests already pending (BatchPolicy.max_pending="
                f"{self.policy.max_pending}, overflow='reject'); retry later, raise max_pending, or use "
                "overflow='block'"
            )
        loop = self._loop
        assert loop is not None
        self._seq += 1
        now = loop.time()
        if group is None:
            group = getattr(item, "group", None)
        req = Request(self._seq, item, num_tokens, now, loop.create_future(), deadline_s, group)
        self._stats.submitted += 1
        self._stats.step_last_submit = now
        if deadline_s is not None and deadline_s != math.inf:
            req.timer = loop.call_at(now + deadline_s, self._expire, req)
        if blocked:
            room.put_blocked(req)
        else:
            room.put(req)
        self._step_count += 1
        if self._expect_n is not None and self._step_count >= self._expect_n:
            self._start_drain("expect")
        else:
            self._changed.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            self._cancel(req)
            raise

    def drain(self) -> int:
        """Flush everything pending now, without waiting for batches to fill (the end of a rollout step; ends the
        step of :meth:`expect`); returns how many requests that covers. With several free slots the drained requests
        are split evenly across them; requests submitted after the call wait as usual."""
        covered = len(self._room) + self._room.blocked
        self._start_drain("drain")
        return covered

    def expect(self, n: int) -> None:
        """Expect ``n`` more requests in the current step (which starts at build and at every drain; earlier submits
        of the step count, and calls add up); drain as soon as they have all arrived. If fewer come, they flush on
        age as usual."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"expect(n) needs an integer n >= 1 (the number of requests of this step), got {n!r}")
        self._expect_n = n + (self._expect_n or 0)
        if self._step_count >= n:
            self._start_drain("expect")

    async def hold(self, timeout_s: float) -> bool:
        """Start no new batch until :meth:`resume` (requests keep queueing, their deadlines running) and wait, at most
        ``timeout_s``, for the running batches to end: True when none is running (the slots may sleep)."""
        self._held = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._runner.running and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._runner.running), timeout=left)
        return not self._runner.running

    def resume(self) -> None:
        """Form batches again (after :meth:`hold`); what queued meanwhile flushes by the usual rule."""
        self._held = False
        self._changed.set()

    @property
    def held(self) -> bool:
        return self._held

    def lose_slot(self, index: int, cause: BaseException) -> bool:
        """Slot ``index``, free, is gone (its replica died between batches): replace or retire it as a slot lost in
        a batch is. False when the slot is not free (a batch or a replacement will notice)."""
        return self._slots.lose_idle(index, cause)

    @property
    def slots(self) -> tuple[Any, ...]:
        """The current slot objects, in slot order (a replaced slot shows its replacement)."""
        return tuple(self._slots.slots)

    def stats(self) -> dict[str, Any]:
        """Counters, batch size/fill/padding, wait and execution time percentiles (ms), flush reasons, queue state."""
        running = self._runner.running
        live = {
            "queue_len": len(self._room),
            "blocked": self._room.blocked,
            "in_flight_batches": len(running),
            "in_flight_requests": sum(req.state == RUNNING for batch in running.values() for req in batch),
            "slots": len(self._slots),
            "free_slots": len(self._slots.free),
            **self._slots.summary(),
            "closed": self._closed,
            "loop_alive": self._supervisor is not None and not self._supervisor.done(),
        }
        return self._stats.snapshot(live)

    def pop_step_stats(self) -> StepStats:
        """Figures of the current step (since the previous call, or since the executor started); starts a new one."""
        loop = self._loop
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        slots = self._slots
        return self._stats.pop_step(len(slots), None if loop is None else loop.time(), slots.usable,
                                    slots.counts["replaced"])

    async def aclose(self, *, grace_s: float = 10.0) -> None:
        """Stop (idempotent): waiting requests and new submits fail with ``ExecutorClosedError``; running batches
        get ``grace_s`` to finish, then are cancelled and their requests fail alike."""
        if self._closed:
            return
        self._closed = True
        self._fail_waiting(partial(ExecutorClosedError,
                                   f"executor {self._name!r} was closed while the request waited for a batch"))
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.cancel()
            await asyncio.wait({supervisor})
        await self._slots.aclose()
        await self._runner.aclose(grace_s)

    async def __aenter__(self) -> PendingRequestExecutor:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ the batching loop

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            if self._stats.step_t0 is None:
                self._stats.step_t0 = loop.time()
        elif self._loop is not loop:
            raise RuntimeError(f"executor {self._name!r} is bound to another event loop; use one executor per loop")
        self._supervisor = loop.create_task(self._supervise(), name=f"{self._name}-batching-loop")
        self._supervisor.add_done_callback(self._on_supervisor_done)

    async def _supervise(self) -> None:
        """Run the batching loop; if it raises, fail every waiting request with the cause and start it again."""
        while not self._closed:
            try:
                await self._batch_loop()
            except Exception as exc:  # noqa: BLE001 - the supervisor's job is to survive anything
                self._stats.loop_restarts += 1
                self._crash_streak += 1
                logger.error("executor %r: batching loop crashed; failing %d waiting requests and restarting",
                             self._name, len(self._room) + self._room.blocked, exc_info=exc)
                self._fail_waiting(partial(ExecutorCrashedError.from_cause, self._name, exc))
                if self._crash_streak > 1:  # crashing again without a batch in between: back off a little
                    await asyncio.sleep(min(1.0, 0.001 * 2 ** min(self._crash_streak, 10)))

    def _on_supervisor_done(self, task: asyncio.Task) -> None:
        """The supervisor itself ended (cancelled from outside, or a BaseException): fail what waits for it."""
        if self._closed or self._supervisor is not task:
            return  # closing, or a new loop has already taken over the waiting requests
        self._supervisor = None  # the next submit starts a new loop
        cause: BaseException = asyncio.CancelledError() if task.cancelled() else (
            task.exception() or RuntimeError("the batching loop returned"))
        waiting = len(self._room) + self._room.blocked
        log = logger.error if waiting else logger.debug
        log("executor %r: batching loop stopped (%r); failing %d waiting requests", self._name, cause, waiting)
        self._fail_waiting(partial(ExecutorCrashedError.from_cause, self._name, cause))

    async def _batch_loop(self) -> None:
        """Form a batch whenever a slot is free and the flush rule says so; else sleep until something changes or
        the rule's time comes."""
        loop, room, free, changed = self._loop, self._room, self._slots.free, self._changed
        assert loop is not None
        while not self._closed:
            changed.clear()
            wake_at = None
            if free and not self._held:
                now = loop.time()
                reason, wake_at = room.next_flush(now)
                if reason is not None:
                    self._dispatch(reason, now)
                    continue
            # Sleep until the queue or the slots change, or the rule's time comes (the event is set then too).
            timer = None if wake_at is None else loop.call_at(wake_at, changed.set)
            try:
                await changed.wait()
            finally:
                if timer is not None:
                    timer.cancel()

    def _dispatch(self, reason: str, now: float) -> None:
        """Take one batch out of the queue and start it on the oldest free slot."""
        picked = self._room.take_batch(reason, now, len(self._slots.free))
        try:
            batch = []
            wait_s = self._stats.wait_s
            for req in picked:
                if req.future.done():  # cancelled; the caller's task has not run its handler yet
                    self._settle(req, None, None)
                    continue
                req.state = RUNNING
                batch.append(req)
                wait_s.add(now - req.t_submit)
            if batch:
                lengths = [req.num_tokens for req in batch]
                self._stats.record_batch(len(batch), None if None in lengths else lengths, reason)
                self._runner.start(batch)
                self._crash_streak = 0
        except BaseException as exc:  # whatever was taken out of the queue must not be stranded
            for req in picked:
                self._settle(req, None, ExecutorCrashedError.from_cause(self._name, exc))
            raise

    def _start_drain(self, reason: str) -> None:
        self._room.drain_seq, self._room.drain_reason = self._seq, reason
        self._step_count, self._expect_n = 0, None
        self._changed.set()

    # ------------------------------------------------------------------ settling requests

    def _settle(self, req: Request, value: Any, exc: BaseException | None) -> None:
        """Resolve ``req`` once (a no-op if it is DONE). The caller has already taken it out of the queue."""
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
        stats.step_last_settle = self._loop.time()  # type: ignore[union-attr]
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
        """Take a waiting request out of the queue before settling it; blocked ones may take its place."""
        if req.state == PENDING or req.state == BLOCKED:
            self._room.remove(req)
            self._changed.set()

    def _cancel(self, req: Request) -> None:
        """The caller's ``submit`` was cancelled: drop the request (a running batch just loses its result)."""
        if req.state == DONE:
            return
        self._unlink(req)
        self._settle(req, None, None)  # its future is cancelled already: counted as cancelled

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
        self._changed.set()

    def _on_slots_change(self) -> None:
        """A slot became free, or was lost for good: wake the loop; with no slot left, fail who waits."""
        if not self._slots.usable:
            self._fail_waiting(self._no_slots_error)
        self._changed.set()

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
