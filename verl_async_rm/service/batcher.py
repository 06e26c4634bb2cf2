"""The RM service's batcher: single requests in, batches out to free replicas (pure asyncio, no Ray, no threads).

A batch leaves only for a free replica (work-conserving), when ``max_batch_size`` requests or ``max_batch_tokens``
tokens wait, the OLDEST has waited ``max_wait_ms``, or a flush covers it (:mod:`.batching`); batches group similar
lengths. Every request resolves exactly once. ``batch_fn(items, replica, deadline)`` returns one result per item
(an item's error is a value like any result, resolved as it is); what it raises fails the batch, except
:class:`ReplicaLostError`: the batch goes back to the queue, the replica is replaced."""

from __future__ import annotations

import asyncio
import logging
import math
import operator
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Generic, TypeVar

from verl_async_rm.errors import (BatcherClosedError, BatcherCrashedError, BatchResultError, NoReplicasError,
                                  ReplicaLostError, RequestTimeoutError)
from verl_async_rm.service.batcher_stats import BatcherStats, StepStats
from verl_async_rm.service.batching import DONE, PENDING, RUNNING, BatchPolicy, Request, RequestQueue

__all__ = ["Batcher", "BatchFn", "ReplaceFn", "REPLICA_STATES"]

logger = logging.getLogger(__name__)

REPLICA_STATES = ("free", "busy", "timed_out", "replacing", "lost")

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")
#: ``async batch_fn(items, replica, deadline) -> list``: one result per item, in order (an error for one item is a
#: value too). ``deadline``: the loop time by which every item of the batch has timed out (``math.inf``: one has no
#: deadline); work past it is wasted.
BatchFn = Callable[[list[ItemT], Any, float], Awaitable[Sequence[ResultT]]]
#: ``async replace(old_replica, index) -> new replica``; raises if it cannot.
ReplaceFn = Callable[[Any, int], Awaitable[Any]]


class Batcher(Generic[ItemT, ResultT]):
    """Batches single requests onto ``replicas`` (an int N: ``0..N-1``, or objects such as actor handles; see the
    module doc). ``replace_replica`` replaces a lost replica, else it is retired; with none left requests fail with
    :class:`NoReplicasError`. Binds to the event loop of its first ``submit``."""

    def __init__(self, batch_fn: BatchFn[ItemT, ResultT], policy: BatchPolicy | None = None, *,
                 replicas: int | Sequence[Any] = 1,
                 name: str = "batcher", replace_replica: ReplaceFn | None = None) -> None:
        if not callable(batch_fn):
            raise TypeError(f"batch_fn must be an async callable `(items, replica, deadline) -> list`, got "
                            f"{batch_fn!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int | list | tuple) or not replicas or (
                isinstance(replicas, int) and replicas < 1):
            raise ValueError(f"replicas={replicas!r}: give a count >= 1 or a non-empty list of replicas")
        self.policy = policy or BatchPolicy()
        self.replicas = list(range(replicas)) if isinstance(replicas, int) else list(replicas)
        self._batch_fn, self._replace, self._name = batch_fn, replace_replica, name
        self._state = ["free"] * len(self.replicas)
        self._free: deque[int] = deque(range(len(self.replicas)))
        self._counts = Counter(lost=0, replaced=0, replace_failed=0, timed_out=0)
        self._stats = BatcherStats(self.policy.max_batch_size)
        self._requests = self._stats.counts  # each request's outcome (counted into twice per request)
        self._queue = RequestQueue(self.policy)
        self._running: dict[asyncio.Task, list[Request]] = {}  # batch task -> its requests
        self._tasks: set[asyncio.Task] = set()  # replacements under way
        self._changed = asyncio.Event()  # the loop sleeps on it; set when the queue or the replicas change
        self._seq = 0
        self._flush_after: int | None = None  # flush once this many requests of the step have arrived
        self._step_count = 0  # submits since the last flush
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._closed = self._closing = self.paused = False

    async def submit(self, item: ItemT, *, num_tokens: int | None = None, deadline_s: float | None = None,
                     group: Any = None) -> ResultT:
        """Queue ``item``; return its result (an item's error too, as ``batch_fn`` gave it), or raise what kept the
        batcher from getting one (closed, timed out, its batch failed...). ``num_tokens`` is required with
        ``max_batch_tokens``; ``deadline_s`` (seconds from now, waiting or running; None or ``math.inf``: none; 0 or
        less: passed already, a caller's time left that ran out: the request times out at once, counted as any);
        ``group``: siblings' shared key (default: ``item.group``, as ``RMRequest`` has)."""
        if self._closed:
            self._requests.rejected += 1
            raise BatcherClosedError(f"batcher {self._name!r} is closed; it accepts no new requests")
        if not self.usable:
            self._requests.rejected += 1
            raise self._no_replicas_error()
        if num_tokens is not None:
            if num_tokens.__class__ is not int and (isinstance(num_tokens, bool)
                                                     or not hasattr(num_tokens, "__index__")):
                raise TypeError(f"num_tokens must be an integer, got {num_tokens!r}")
            if (num_tokens := operator.index(num_tokens)) < 0:
                raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        elif self.policy.max_batch_tokens is not None:
            raise ValueError(f"submit(num_tokens=None) but max_batch_tokens={self.policy.max_batch_tokens}: pass the "
                             "item's length as num_tokens")
        if deadline_s is not None and math.isnan(deadline_s):
            raise ValueError(f"deadline_s must be a number of seconds (None for none), got {deadline_s!r}")
        if self._task is None or self._task.done():  # (re)start the loop; the first submit binds the batcher to it
            loop = asyncio.get_running_loop()
            if self._loop is None:
                self._loop, self._stats.step_t0 = loop, loop.time()
            elif self._loop is not loop:
                raise RuntimeError(f"batcher {self._name!r} is bound to another event loop; use one batcher per loop")
            self._task = loop.create_task(self._run_loop(), name=f"{self._name}-batching-loop")
            self._task.add_done_callback(self._loop_ended)
        loop = self._loop
        self._seq += 1
        now = loop.time()  # type: ignore[union-attr]
        req = Request(self._seq, item, num_tokens, now, loop.create_future(), deadline_s,  # type: ignore[union-attr]
                      getattr(item, "group", None) if group is None else group)
        self._requests.submitted += 1
        self._stats.last_submit = now
        if deadline_s is not None and deadline_s != math.inf:
            req.timer = loop.call_at(now + deadline_s, self._expire, req)  # type: ignore[union-attr]
        self._queue.put(req)
        self._step_count += 1
        if self._flush_after is not None and self._step_count >= self._flush_after:
            self._start_flush()
        else:
            self._changed.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            if req.state != DONE:
                self._unqueue(req)
                self._resolve(req, None, None)  # its future is cancelled: counted as cancelled
            raise

    def flush(self) -> int:
        """Flush what waits now, split evenly over the free replicas (the end of a step); returns how many."""
        self._start_flush()
        return len(self._queue)

    def flush_after(self, n: int) -> None:
        """``n`` more requests belong to the current step (it starts at build and at every flush; earlier submits of
        the step count, calls add up): flush the moment they have all arrived. Fewer leave on age as usual."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"flush_after(n) needs an integer n >= 1 (requests of this step), got {n!r}")
        self._flush_after = n + (self._flush_after or 0)
        if self._step_count >= self._flush_after:
            self._start_flush()

    async def pause(self, timeout_s: float) -> bool:
        """Start no batch until :meth:`resume` (requests queue, deadlines run); wait at most ``timeout_s`` for the
        running batches: True when none runs (the replicas may sleep)."""
        self.paused = True
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while self._running and (left := end - loop.time()) > 0:
            await asyncio.wait(set(self._running), timeout=left)
        return not self._running

    def resume(self) -> None:
        self.paused = False
        self._changed.set()

    def lose_replica(self, index: int, cause: BaseException) -> bool:
        """Replica ``index``, free, is gone (found dead between batches): replace or retire it. False when it is not
        free (its batch or replacement will tell)."""
        if self._state[index] != "free":
            return False
        self._free.remove(index)
        self._lose(index, cause)
        return True

    @property
    def usable(self) -> int:
        """Replicas that take batches now or soon: all but the lost ones."""
        return sum(state != "lost" for state in self._state)

    def stats(self) -> dict[str, Any]:
        """Counters, batch size/fill/padding, wait and execution time percentiles (ms), flush reasons, queue and
        replica states."""
        states = Counter(self._state)
        live = {
            "queue_len": len(self._queue), "in_flight_batches": len(self._running),
            "in_flight_requests": sum(r.state == RUNNING for batch in self._running.values() for r in batch),
            "replicas": len(self.replicas), **{f"replicas_{s}": states.get(s, 0) for s in REPLICA_STATES},
            **{f"replicas_{k}_total": v for k, v in self._counts.items()}, "closed": self._closed,
            "loop_alive": self._task is not None and not self._task.done()}
        return self._stats.snapshot(live)

    def pop_step_stats(self) -> StepStats:
        """Figures since the previous call (or the start); starts a new step."""
        now = None if self._loop is None else self._loop.time()  # no submit yet: no step time either
        return self._stats.pop_step(len(self.replicas), now, self.usable, self._counts["replaced"])

    async def aclose(self, *, grace_s: float = 10.0) -> None:
        """Stop (idempotent): waiting requests and new submits fail with :class:`BatcherClosedError`; running
        batches get ``grace_s``, then are cancelled and their requests fail alike."""
        if self._closed:
            return
        self._closed = True
        self._fail_waiting(lambda: BatcherClosedError(
            f"batcher {self._name!r} was closed while the request waited for a batch"))
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        tasks, self._tasks = self._tasks, set()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        running = set(self._running)
        if running and grace_s > 0:
            _, running = await asyncio.wait(running, timeout=grace_s)
        if running:
            self._closing = True
            for t in running:
                t.cancel()
            await asyncio.wait(running, timeout=1.0)  # bounded: a batch_fn may ignore the cancellation
            for t in running:
                for req in self._running.get(t, ()):
                    self._resolve(req, None, self._closed_error())

    async def __aenter__(self) -> Batcher:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _run_loop(self) -> None:
        """The batching loop; if it raises, every waiting request fails with the cause and the loop starts again."""
        crashes = 0
        while not self._closed:
            try:
                await self._batch_loop()
            except Exception as exc:  # noqa: BLE001 - no bug in here may strand a caller
                self._stats.loop_restarts += 1
                crashes += 1
                logger.error("batcher %r: batching loop crashed; failing %d waiting requests and restarting",
                             self._name, len(self._queue), exc_info=exc)
                self._fail_waiting(partial(BatcherCrashedError.from_cause, self._name, exc))
                if crashes > 1:  # crashing again at once: back off a little
                    await asyncio.sleep(min(1.0, 0.001 * 2 ** min(crashes, 10)))

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The loop task itself ended (cancelled from outside): fail who waits; the next submit starts a new one."""
        if self._closed or self._task is not task:
            return
        self._task = None
        cause = asyncio.CancelledError() if task.cancelled() else task.exception() or RuntimeError("loop returned")
        if self._queue:
            logger.error("batcher %r: batching loop stopped (%r); failing %d waiting requests", self._name, cause,
                         len(self._queue))
        self._fail_waiting(partial(BatcherCrashedError.from_cause, self._name, cause))

    async def _batch_loop(self) -> None:
        loop, queue, free, changed = self._loop, self._queue, self._free, self._changed
        while not self._closed:
            changed.clear()
            wake_at = None
            if free and not self.paused:
                now = loop.time()  # type: ignore[union-attr]
                reason, wake_at = queue.departure(now)
                if reason is not None:
                    self._dispatch(reason, now)
                    continue
            timer = None if wake_at is None else loop.call_at(wake_at, changed.set)  # type: ignore[union-attr]
            try:
                await changed.wait()
            finally:
                if timer is not None:
                    timer.cancel()

    def _dispatch(self, reason: str, now: float) -> None:
        """Take one batch out of the queue and run it on the longest-free replica."""
        picked = self._queue.take_batch(now, len(self._free))
        try:
            batch = []
            for req in picked:
                if req.future.done():  # cancelled; the caller's handler has not run yet
                    self._resolve(req, None, None)
                    continue
                req.state = RUNNING
                batch.append(req)
                self._stats.wait_s.add(now - req.t_submit)
            if batch:
                lengths = [req.num_tokens for req in batch]
                self._stats.record_batch(len(batch), None if None in lengths else lengths, reason)
                index = self._free[0]
                task = self._loop.create_task(self._run(batch, index))  # type: ignore[union-attr]
                self._free.popleft()
                self._state[index] = "busy"
                self._running[task] = batch
                task.add_done_callback(self._batch_done)
        except BaseException as exc:  # what left the queue must not be stranded
            for req in picked:
                self._resolve(req, None, BatcherCrashedError.from_cause(self._name, exc))
            raise

    def _start_flush(self) -> None:
        self._queue.flush_seq = self._seq
        self._step_count, self._flush_after = 0, None
        self._changed.set()

    async def _run(self, batch: list[Request], index: int) -> None:
        lost: ReplicaLostError | None = None
        try:
            lost = await self._call(batch, index)
        except asyncio.CancelledError:  # closing: gave up on the batch
            for req in batch:
                self._resolve(req, None, self._closed_error())
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must not strand callers
            logger.error("batcher %r: running a batch failed unexpectedly", self._name, exc_info=exc)
            for req in batch:
                self._resolve(req, None, BatcherCrashedError.from_cause(self._name, exc))
        finally:
            if lost is None:
                self._release(index)
            else:
                self._lose(index, lost)

    async def _call(self, batch: list[Request], index: int) -> ReplicaLostError | None:
        """``batch_fn`` on replica ``index``; resolves the batch. Returns the error when the replica is lost."""
        loop = self._loop
        timeout_s = self.policy.batch_timeout_s
        timer = None
        if timeout_s is not None:
            timer = loop.call_later(timeout_s, self._time_out, asyncio.current_task(), batch, index)  # type: ignore
        t0 = loop.time()  # type: ignore[union-attr]
        results: Any = None
        exc: BaseException | None = None
        try:
            awaitable = self._batch_fn([req.item for req in batch], self.replicas[index], _deadline(batch))
            if not isinstance(awaitable, Awaitable):
                raise BatchResultError(f"batch_fn returned {type(awaitable).__name__}, not an awaitable: it must be "
                                       "`async def batch_fn(items, replica, deadline)` (a blocking call stalls every "
                                       "caller)")
            results = await awaitable
        except asyncio.CancelledError:
            if self._closing:
                raise
            if self._state[index] != "timed_out":  # nothing cancelled it: batch_fn raised it by itself
                exc = BatchResultError("batch_fn raised CancelledError although nothing cancelled the batch")
        except Exception as err:  # noqa: BLE001 - whatever batch_fn raises is the batch's outcome
            exc = err
        finally:
            if timer is not None:
                timer.cancel()
        if self._state[index] == "timed_out":  # its requests failed at the timeout already
            logger.info("batcher %r: the timed-out call on replica %d has ended%s", self._name, index,
                        "" if exc is None else f" with {exc!r}")
            return exc if isinstance(exc, ReplicaLostError) else None
        self._stats.exec_s.add(loop.time() - t0)  # type: ignore[union-attr]
        if exc is None:
            if isinstance(results, list | tuple) and len(results) == len(batch):
                for req, value in zip(batch, results):  # an item's error is its result too
                    self._resolve(req, value, None)
                return None
            got = f"{len(results)} results" if isinstance(results, list | tuple) else type(results).__name__
            exc = BatchResultError(f"batch_fn returned {got} for a batch of {len(batch)} items; it must return a "
                                   "list with one entry per item, in order")
        if isinstance(exc, ReplicaLostError):
            self._requeue(batch, exc)
            return exc
        logger.warning("batcher %r: batch_fn failed on a batch of %d (replica %r): %s: %s", self._name, len(batch),
                       self.replicas[index], type(exc).__name__, exc)
        for req in batch:
            self._resolve(req, None, exc)
        return None

    def _time_out(self, task: asyncio.Task, batch: list[Request], index: int) -> None:
        """``batch_timeout_s`` passed: fail the batch now and cancel its call; the replica takes no batch until the
        call has really ended."""
        timeout_s = self.policy.batch_timeout_s
        self._stats.exec_s.add(timeout_s)  # type: ignore[arg-type]
        error = RequestTimeoutError(
            f"batcher {self._name!r}: a batch of {len(batch)} ran longer than batch_timeout_s={timeout_s:g} s on "
            f"replica {index} ({self.replicas[index]!r}); the call was cancelled and the replica takes no new batch "
            "until it has ended. Raise async_rm.batch_timeout_s if the RM is just slow")
        for req in batch:
            self._resolve(req, None, error)
        self._state[index] = "timed_out"
        self._counts["timed_out"] += 1
        logger.warning("batcher %r: replica %d gets no batch until its timed-out call has ended", self._name, index)
        task.cancel()

    def _batch_done(self, task: asyncio.Task) -> None:
        self._running.pop(task, None)
        if not task.cancelled() and task.exception() is not None:  # _run resolves everything; log regardless
            logger.error("batcher %r: batch task failed", self._name, exc_info=task.exception())

    def _requeue(self, batch: list[Request], exc: ReplicaLostError) -> None:
        """The requests of a lost replica's batch go back to the head of the queue (or fail: retries used up, or
        closing)."""
        again = []
        for req in batch:
            if req.state != RUNNING:
                continue
            if self._closed:
                self._resolve(req, None, BatcherClosedError(
                    f"batcher {self._name!r} was closed while the request's replica was lost ({exc})"))
            elif req.requeued >= self.policy.replica_retries:
                self._resolve(req, None, exc)
            else:
                req.requeued += 1
                again.append(req)
        self._queue.requeue(again)
        self._requests.requeued += len(again)
        self._changed.set()

    def _release(self, index: int) -> None:
        self._state[index] = "free"
        self._free.append(index)
        self._changed.set()

    def _lose(self, index: int, cause: BaseException) -> None:
        """Replace the lost replica (in the background), or retire it."""
        self._counts["lost"] += 1
        if self._replace is None or self._closed:
            logger.error("batcher %r: replica %d lost (%s); %d left", self._name, index, cause, self.usable - 1)
            self._retire(index)
            return
        logger.warning("batcher %r: replica %d lost (%s); starting a replacement", self._name, index, cause)
        self._state[index] = "replacing"
        task = asyncio.ensure_future(self._do_replace(index))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _do_replace(self, index: int) -> None:
        try:
            new = await self._replace(self.replicas[index], index)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - a failed replacement retires the replica
            self._counts["replace_failed"] += 1
            logger.error("batcher %r: could not replace replica %d: %s; %d left", self._name, index, exc,
                         self.usable - 1)
            self._retire(index)
            return
        self.replicas[index] = new
        self._counts["replaced"] += 1
        logger.warning("batcher %r: replica %d replaced", self._name, index)
        self._release(index)

    def _retire(self, index: int) -> None:
        self._state[index] = "lost"
        if not self.usable:
            self._fail_waiting(self._no_replicas_error)
        self._changed.set()

    def _resolve(self, req: Request, value: Any, exc: BaseException | None) -> None:
        """Resolve ``req`` once (a no-op when it is DONE); it is already out of the queue."""
        if req.state == DONE:
            return
        req.state = DONE
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        fut = req.future
        if fut.done():  # the caller cancelled
            self._requests.cancelled += 1
            return
        self._stats.last_result = self._loop.time()  # type: ignore[union-attr]
        if exc is None:
            fut.set_result(value)
            if not isinstance(value, Exception):
                self._requests.completed += 1
                return
            exc = value  # an item's error, resolved as its result: counted as a failure
        else:
            fut.set_exception(exc)
        if isinstance(exc, RequestTimeoutError):
            self._requests.timed_out += 1
        else:
            self._requests.failed += 1

    def _unqueue(self, req: Request) -> None:
        if req.state == PENDING:
            self._queue.remove(req)
            self._changed.set()

    def _expire(self, req: Request) -> None:
        """Deadline timer: fail the request wherever it is."""
        if req.state == DONE:
            return
        req.timer = None
        where = "waiting for a batch" if req.state == PENDING else "in a running batch"
        self._unqueue(req)
        self._resolve(req, None, RequestTimeoutError(
            f"batcher {self._name!r}: request #{req.seq} missed its deadline of {req.deadline_s:g} s while {where} "
            f"({len(self._queue)} pending, {len(self._free)}/{len(self.replicas)} replicas free, {self.usable} usable)"
        ))

    def _fail_waiting(self, make_exc: Callable[[], BaseException]) -> None:
        for req in self._queue.clear():
            self._resolve(req, None, make_exc())

    def _no_replicas_error(self) -> NoReplicasError:
        return NoReplicasError(
            f"batcher {self._name!r}: all {len(self.replicas)} replica(s) are lost and none could be replaced "
            f"({self._counts['lost']} lost, {self._counts['replace_failed']} replacements failed); see the log")

    def _closed_error(self) -> BatcherClosedError:
        return BatcherClosedError(f"batcher {self._name!r} was closed while the request's batch was running")



def _deadline(batch: Sequence[Request]) -> float:
    """The loop time by which every request of ``batch`` has timed out (``math.inf`` when one has no deadline)."""
    latest = -math.inf
    for req in batch:  # once per request: comparisons, no call
        if req.deadline_s is None:
            return math.inf
        if req.t_submit + req.deadline_s > latest:
            latest = req.t_submit + req.deadline_s
    return latest
