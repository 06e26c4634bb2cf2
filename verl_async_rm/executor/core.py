"""``PendingRequestExecutor``: slot-based dynamic batching in pure asyncio (no Ray, no threads).

Callers ``await submit(item)`` one request at a time; a supervised background loop forms a batch only when a slot (an
RM replica, or the whole sharded RM in whole-group mode) is free and one of the flush triggers holds (size, token
budget, age of the OLDEST request, drain/expect). Each batch runs as its own task on its slot; results, per-item
exceptions, deadlines, cancellations, shutdown and crashes of the loop settle every request exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from verl_async_rm.errors import (
    ExecutorClosedError,
    ExecutorCrashedError,
    QueueFullError,
)
from verl_async_rm.executor.formation import select_batch
from verl_async_rm.executor.policy import BatchPolicy
from verl_async_rm.executor.request import PENDING, RUNNING, Request, check_tokens, normalise_slots
from verl_async_rm.executor.runner import BatchRunner
from verl_async_rm.executor.settling import SettlingMixin
from verl_async_rm.executor.slots import ReplaceFn, SlotTable
from verl_async_rm.executor.stats import ExecutorStats
from verl_async_rm.executor.waiting import WaitingRoom

__all__ = ["PendingRequestExecutor", "BatchFn"]

logger = logging.getLogger(__name__)

#: ``async batch_fn(items, slot) -> list``: one result or ``Exception`` instance per item, in order.
BatchFn = Callable[[list[Any], Any], Awaitable[list[Any]]]

#: Length grouping picks from at most this many batches' worth of requests after the oldest one. Wider groups better
#: under a backlog (overlap bench, 4096 trajectories on 1 replica: padding 0.097 at 4, 0.039 at 16) and costs no
#: fairness: the oldest request is in every batch, so a request with p ahead of it leaves within p + 1 batches.
_GROUP_WINDOW_BATCHES = 16
_CLOCK_RESOLUTION = time.get_clock_info("monotonic").resolution


class PendingRequestExecutor(SettlingMixin):
    """Collect single requests into batches and run them on free slots.

    Args:
        batch_fn: ``async batch_fn(items, slot) -> list``; returns one entry per item, in order: a result, or an
            ``Exception`` instance that fails only that item's caller. If it raises, the batch fails (see
            ``BatchPolicy.bisect_on_error``).
        policy: a :class:`BatchPolicy`, a mapping of its fields, or None for the defaults.
        slots: an int N (slots are then ``0..N-1``) or a sequence of slot objects (for example the Ray actor handles of
            the RM replicas); each batch runs on one free slot, which is passed to ``batch_fn``. Data-parallel
            replicas: one slot each. A sharded RM (whole-group mode): one slot.
        name: used in log lines and error messages.
        replace_slot: optional ``async replace_slot(slot, index) -> new slot``, called when ``batch_fn`` raises
            :class:`SlotLostError` (the slot's requests go back to the head of the queue, at most
            ``policy.slot_retries`` times each); without it a lost slot is retired. With no slot left, waiting
            requests and new submits fail with :class:`NoSlotsError`.

    The executor binds to the event loop of its first ``submit`` and starts its loop then; build it anywhere.
    """

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
        self._slots = SlotTable(normalise_slots(slots), replace=replace_slot, on_change=self._on_slots_change,
                                name=name)
        p = self.policy
        self._max_items = p.max_batch_size
        self._max_tokens = p.max_batch_tokens
        self._max_wait_s = p.max_wait_s
        self._reject = p.overflow == "reject"
        self._default_deadline_s = p.default_deadline_s
        self._stats = ExecutorStats(p.max_batch_size, p.pad_multiple)
        self._runner = BatchRunner(batch_fn, stats=self._stats, settle=self._settle,
                                   bisect_on_error=p.bisect_on_error, batch_timeout_s=p.batch_timeout_s, name=name)
        self._room = WaitingRoom(p.max_pending)
        self._seq = 0
        self._drain_seq = 0  # requests with seq <= this are flushed without waiting
        self._drain_reason = "drain"
        self._expect_n: int | None = None
        self._step_count = 0  # submits since the last drain (the current step)
        self._running: dict[asyncio.Task, list[Request]] = {}
        self._running_requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._supervisor: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None  # set while the loop sleeps
        self._wake_at: float | None = None  # when its timer fires; None: it waits for a slot or a first request
        self._wake_timer: asyncio.TimerHandle | None = None
        self._crash_streak = 0
        self._closed = False

    # ------------------------------------------------------------------ public API

    async def submit(
        self, item: Any, *, num_tokens: int | None = None, deadline_s: float | None = None, group: Any = None
    ) -> Any:
        """Queue ``item`` and return its result, or raise its exception.

        Args:
            item: passed to ``batch_fn`` as is.
            num_tokens: the item's length; required when ``max_batch_tokens`` is set, used for length grouping.
            deadline_s: seconds from now after which the call raises ``RequestTimeoutError`` (waiting or running);
                None uses ``BatchPolicy.default_deadline_s``; ``math.inf`` means no deadline.
            group: a hashable key shared by siblings (GRPO responses to one prompt): with ``prefer_siblings``, a
                batch takes the pending siblings of its oldest request first. None: the item's ``group`` attribute,
                if it has one (:attr:`verl_async_rm.rm.RMRequest.group`).

        Raises:
            QueueFullError: ``max_pending`` requests are waiting and the policy says ``reject``.
            ExecutorClosedError: the executor is closed, or was closed while the request waited.
            ExecutorCrashedError: the batching loop died while the request waited (it restarts by itself).
            RequestTimeoutError: the deadline passed, or the batch ran past ``batch_timeout_s``.
            BatchResultError: ``batch_fn`` broke its contract (wrong number of results...).
            Exception: whatever ``batch_fn`` raised for the batch, or returned for this item.
        """
        if self._closed:
            self._stats.rejected += 1
            raise ExecutorClosedError(f"executor {self._name!r} is closed; it accepts no new requests")
        if not self._slots.usable:
            self._stats.rejected += 1
            raise self._no_slots_error()
        if num_tokens is not None:
            num_tokens = check_tokens(num_tokens)
        elif self._max_tokens is not None:
            raise ValueError(
                f"submit(num_tokens=None) but BatchPolicy.max_batch_tokens={self._max_tokens}: pass the item's "
                "length as num_tokens, or set max_batch_tokens=None"
            )
        if deadline_s is None:
            deadline_s = self._default_deadline_s
        elif not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 seconds (math.inf for none), got {deadline_s!r}")
        supervisor = self._supervisor
        if supervisor is None or supervisor.done():
            self._start()
        room = self._room
        blocked = room.full()
        if blocked and self._reject:
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
            self._maybe_wake()
        try:
            return await req.future
        except asyncio.CancelledError:
            self._cancel(req)
            raise

    def drain(self) -> int:
        """Flush everything pending now, without waiting for batches to fill; returns how many requests that covers.

        Call it when no more requests are coming soon (the end of a rollout step). Batches still form only as slots
        free up; with several free slots the drained requests are split evenly across them. Requests submitted after
        the call wait as usual. Also ends the current step (see :meth:`expect`).
        """
        covered = len(self._room) + self._room.blocked
        self._start_drain("drain")
        return covered

    def expect(self, n: int) -> None:
        """Expect ``n`` more requests in the current step; drain as soon as every expected request has arrived.

        A step starts when the executor is built and at every drain (explicit, or triggered by ``expect``); requests
        submitted before this call but in the same step count. Calls add up, so batches dispatched while earlier ones
        are still running each announce their own count. If fewer requests come, nothing hangs: they flush on age as
        usual; :meth:`drain` ends such a step.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"expect(n) needs an integer n >= 1 (the number of requests of this step), got {n!r}")
        self._expect_n = n + (self._expect_n or 0)
        if self._step_count >= n:
            self._start_drain("expect")

    @property
    def slots(self) -> tuple[Any, ...]:
        """The current slot objects, in slot order (a replaced slot shows its replacement)."""
        return tuple(self._slots.slots)

    def stats(self) -> dict[str, Any]:
        """Counters, batch size/fill/padding, wait and execution time percentiles (ms), flush reasons, queue state."""
        live = {
            "queue_len": len(self._room),
            "blocked": self._room.blocked,
            "in_flight_batches": len(self._running),
            "in_flight_requests": self._running_requests,
            "slots": len(self._slots),
            "free_slots": len(self._slots.free),
            **self._slots.summary(),
            "closed": self._closed,
            "loop_alive": self._supervisor is not None and not self._supervisor.done(),
        }
        return self._stats.snapshot(live)

    def pop_step_stats(self) -> dict[str, Any]:
        """Figures of the current step (since the previous call, or since the executor started); starts a new one.

        Counters are differences; ``wait_ms``/``exec_ms`` summarise this step's batches; ``rm_utilization`` is the
        time batches ran over ``slots * elapsed_s``; ``tail_s`` runs from the last submit to the last answer.
        """
        loop = self._loop
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        out = self._stats.pop_step(len(self._slots), None if loop is None else loop.time())
        out.update(self._slots.summary())
        return out

    async def aclose(self, *, grace_s: float = 10.0) -> None:
        """Stop: waiting requests fail with ``ExecutorClosedError``; running batches get ``grace_s`` to finish.

        Batches still running after ``grace_s`` are cancelled and their requests fail with ``ExecutorClosedError``.
        New submits raise ``ExecutorClosedError``. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._fail_waiting(lambda: ExecutorClosedError(
            f"executor {self._name!r} was closed while the request waited for a batch"))
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.cancel()
            await asyncio.wait({supervisor})
        await self._slots.aclose()
        running = set(self._running)
        if running:
            late = running
            if grace_s > 0:
                _, late = await asyncio.wait(running, timeout=grace_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
            for task in late:  # a batch_fn that swallows cancellation must not keep its callers waiting
                for req in self._running.get(task, ()):
                    self._settle(req, None, ExecutorClosedError(
                        f"executor {self._name!r} was closed while the request's batch was running"))

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
                self._fail_waiting(lambda: ExecutorCrashedError.from_cause(self._name, exc))
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
        self._fail_waiting(lambda: ExecutorCrashedError.from_cause(self._name, cause))

    async def _batch_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        room, free = self._room, self._slots.free
        while not self._closed:
            if not free or not room.pending:
                await self._sleep(None)
                continue
            now = loop.time()
            reason = self._flush_reason(now)
            if reason is None:
                await self._sleep(room.head().t_submit + self._max_wait_s)
                continue
            self._dispatch(reason, now)

    def _flush_reason(self, now: float) -> str | None:
        room = self._room
        if len(room) >= self._max_items:
            return "size"
        if self._max_tokens is not None and room.tokens >= self._max_tokens:
            return "tokens"
        head = room.head()
        if head.seq <= self._drain_seq:
            return self._drain_reason
        if now + _CLOCK_RESOLUTION >= head.t_submit + self._max_wait_s:
            return "age"
        return None

    def _dispatch(self, reason: str, now: float) -> None:
        """Form one batch from the queue and start it on the first free slot."""
        room, free = self._room, self._slots.free
        max_items, max_tokens = self._max_items, self._max_tokens
        if reason in ("drain", "expect") and len(free) > 1 and len(room) > 1:
            share = min(len(free), len(room))  # spread a drain evenly over the free slots
            max_items = min(max_items, -(-len(room) // share))
            if room.tokens:
                per_slot = -(-room.tokens // share)
                max_tokens = per_slot if max_tokens is None else min(max_tokens, per_slot)
        picked = select_batch(
            room.pending.values(), count=len(room), pending_tokens=room.tokens, max_items=max_items,
            max_tokens=max_tokens, due_before=now + _CLOCK_RESOLUTION - self._max_wait_s,
            group_by_length=self.policy.group_by_length, window=_GROUP_WINDOW_BATCHES * self._max_items,
            prefer_siblings=self.policy.prefer_siblings,
        )
        try:
            self._start_batch(picked, reason, now)
        except BaseException as exc:
            for req in picked:  # whatever was taken out of the queue must not be stranded
                if req.state == PENDING and req.seq in room.pending:
                    room.take(req)
                if not any(req in batch for batch in self._running.values()):
                    self._settle(req, None, ExecutorCrashedError.from_cause(self._name, exc))
            raise

    def _start_batch(self, picked: list[Request], reason: str, now: float) -> None:
        room = self._room
        batch: list[Request] = []
        lengths: list[int] = []
        all_lengths = True
        wait_s = self._stats.wait_s
        for req in picked:
            room.take(req)
            if req.future.done():  # cancelled; the caller's task has not run its handler yet
                self._settle(req, None, None)
                continue
            if req.num_tokens is None:
                all_lengths = False
            else:
                lengths.append(req.num_tokens)
            req.state = RUNNING
            batch.append(req)
            wait_s.add(now - req.t_submit)
        if room.blocked:
            room.admit()
        if not batch:
            return
        self._stats.record_batch(len(batch), lengths if all_lengths else None, reason)
        slot_index = self._slots.take()
        try:
            task = asyncio.get_running_loop().create_task(self._run_batch(batch, slot_index))
        except BaseException:
            self._slots.untake(slot_index)
            raise
        self._running[task] = batch
        self._running_requests += len(batch)
        task.add_done_callback(self._on_batch_done)
        self._crash_streak = 0

    async def _run_batch(self, batch: list[Request], slot_index: int) -> None:
        verdict = None
        try:
            verdict = await self._runner.run(batch, self._slots.slots[slot_index])
        except asyncio.CancelledError:
            for req in batch:
                self._settle(req, None, ExecutorClosedError(
                    f"executor {self._name!r} was closed while the request's batch was running"))
            raise
        except Exception as exc:  # noqa: BLE001 - a bug in the runner must not strand callers
            logger.error("executor %r: running a batch failed unexpectedly", self._name, exc_info=exc)
            for req in batch:
                self._settle(req, None, ExecutorCrashedError.from_cause(self._name, exc))
        finally:
            self._running_requests -= len(batch)
            if verdict is not None and verdict.lost is not None:
                self._requeue(batch, verdict.lost)
                self._slots.lose(slot_index, verdict.lost)
            elif verdict is not None and verdict.busy_until is not None:
                self._slots.hold(slot_index, verdict.busy_until)
            else:
                self._slots.release(slot_index)
            self._notify()

    def _on_batch_done(self, task: asyncio.Task) -> None:
        self._running.pop(task, None)
        if not task.cancelled() and task.exception() is not None:  # _run_batch settles everything; log regardless
            logger.error("executor %r: batch task failed", self._name, exc_info=task.exception())

    # ------------------------------------------------------------------ waking the loop

    async def _sleep(self, when: float | None) -> None:
        """Sleep until ``_notify``, or until the loop time ``when`` (if given, or armed later by ``_maybe_wake``)."""
        loop = self._loop
        assert loop is not None
        fut = loop.create_future()
        self._wake = fut
        self._arm(when)
        try:
            await fut
        finally:
            self._wake = None
            self._arm(None)

    def _arm(self, when: float | None) -> None:
        """Set (or with None, cancel) the timer that ends the loop's current sleep."""
        if self._wake_timer is not None:
            self._wake_timer.cancel()
            self._wake_timer = None
        self._wake_at = when
        if when is not None and self._wake is not None:
            self._wake_timer = self._loop.call_at(when, _set_done, self._wake)  # type: ignore[union-attr]

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _maybe_wake(self) -> None:
        """Wake the loop if the queue just changed in a way that can flush a batch before its timer."""
        wake = self._wake
        room = self._room
        if wake is None or wake.done() or not self._slots.free or not room.pending:
            return
        if len(room) >= self._max_items or (self._max_tokens is not None and room.tokens >= self._max_tokens):
            wake.set_result(None)
        elif self._wake_at is None:  # the loop sleeps on an empty queue: time the new head's max_wait from here
            when = room.head().t_submit + self._max_wait_s
            if when <= self._loop.time() + _CLOCK_RESOLUTION:  # type: ignore[union-attr]
                wake.set_result(None)  # already due (max_wait_ms=0, or an old request admitted from overflow)
            else:
                self._arm(when)

    def _start_drain(self, reason: str) -> None:
        self._drain_seq, self._drain_reason = self._seq, reason
        self._step_count, self._expect_n = 0, None
        self._notify()

def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
