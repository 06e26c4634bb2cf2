"""``RMService``: one reward model as a Ray actor that owns its pool, its replicas, the batcher and the statistics.

Agent-loop workers call only :meth:`RMService.score` (through :func:`~verl_async_rm.service.client.score_with_timeout`);
the manager starts the service, marks the steps and closes it. Nothing outside the service holds a replica handle: the
replicas and their stand-ins are owned by this actor, so they go with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from verl_async_rm.batching import BatchPolicy, PendingRequestExecutor
from verl_async_rm.errors import AsyncRMError, ReplicaLostError
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.scorer import ScorerStats
from verl_async_rm.service.metrics import service_step_metrics
from verl_async_rm.service.placement import (
    ReplicaFactory,
    create_rm_worker_group,
    kill_and_wait,
    kill_quietly,
    shutdown_rm_worker_group,
)
from verl_async_rm.service.replica_call import ReplicaCall
from verl_async_rm.service.sleep import SleepLedger

logger = logging.getLogger(__name__)

__all__ = ["RMService", "start_rm_service", "launch_rm_service", "start_timeout_s", "kill_quietly",
           "DEFAULT_LATE_LIMIT_S"]

#: How long a replica may go on with a call the executor gave up on when ``batch_timeout_s`` is None (closing).
DEFAULT_LATE_LIMIT_S = 60.0
#: Longest wait for one replica's step counters at a step's end.
_REPLICA_STATS_TIMEOUT_S = 30.0
_REPLICA_STOP_WAIT_S = 30.0  # how long close waits for its killed replicas to be gone


class RMService:
    """One RM as a Ray async actor (see :func:`start_rm_service`).

    ``name`` names the pool's placement groups, the replicas and the log lines (a service started again under the
    same name removes what its dead predecessor left). ``replace_replicas``: a stand-in for a replica that died, else
    it is retired. ``late_limit_s``: how long a replica may go on with a call given up on before it is killed and
    replaced; default ``2 * batch_timeout_s`` (:data:`DEFAULT_LATE_LIMIT_S` without a batch timeout).
    """

    def __init__(self, rm: RMConfig, batching: BatchPolicy, *, name: str, replace_replicas: bool = True,
                 late_limit_s: float | None = None) -> None:
        self._rm = rm
        self._batching = batching
        self._name = name
        self._replace = replace_replicas
        timeout_s = batching.batch_timeout_s
        self._late_limit_s = late_limit_s or (2.0 * timeout_s if timeout_s else DEFAULT_LATE_LIMIT_S)
        self._group: Any = None
        self._executor: PendingRequestExecutor | None = None
        self._abandoned: set[asyncio.Task] = set()  # whole-batch calls given up on, still waiting for late answers
        #: placement='policy_pool': awake or asleep, and the step's sleep/wake figures; None for a pool of its own.
        self._sleep = SleepLedger() if rm.placement == "policy_pool" else None
        #: Replicas that did not answer the sleep, by slot: lost at the wake if the slot still holds them (a slot
        #: being replaced then holds a dead replica, and its stand-in loads awake).
        self._failed_sleep: dict[int, Any] = {}

    async def start(self) -> list[dict[str, Any]]:
        """Reserve the pool, load the RM on every replica and start the batcher; returns each replica's ``describe``
        (raises what kept them from starting, after releasing what was reserved)."""
        if self._executor is not None:
            return await self.describe()
        # Placement and loading block on Ray calls: a thread keeps this actor's loop free to answer meanwhile.
        self._group = await asyncio.to_thread(create_rm_worker_group, self._rm, None, f"{self._name}_")
        self._executor = PendingRequestExecutor(
            ReplicaCall(late_limit_s=self._late_limit_s),
            self._batching,
            slots=list(self._group.workers),
            name=self._name,
            replace_slot=ReplicaFactory(self._rm, self._group) if self._replace else None,
        )
        logger.info("RM service %s: %d replica(s) of %s, batching %s", self._name, self._rm.num_replicas,
                    self._rm.model_path, self._batching.to_dict())
        return await self.describe()

    async def score(self, request: RMRequest, deadline_s: float | None = None) -> float:
        """The RM score of one trajectory, or the exception that kept it from being scored (``RequestTimeoutError``
        past ``deadline_s``). A caller that gives up (``ray.cancel``) takes its request out of the queue."""
        return await self._require().submit(request, num_tokens=request.num_tokens, deadline_s=deadline_s)

    async def begin_step(self, expected: int | None = None) -> None:
        """Start a step: the step's figures count from here; with ``expected``, see :meth:`expect`."""
        self._require().pop_step_stats()
        if expected:
            self._require().expect(int(expected))

    async def expect(self, n: int) -> None:
        """``n`` more trajectories belong to this step: the last batch flushes the moment the last one arrives."""
        self._require().expect(int(n))

    async def end_step(self) -> dict[str, float]:
        """End a step: flush what is pending and return the step's figures (``service_step_metrics``), with the
        replicas' own counters (a replica that does not answer in time is left out)."""
        executor = self._require()
        executor.drain()
        executor_step = executor.pop_step_stats()
        replica_steps = await asyncio.gather(
            *(_bounded(replica.pop_step_stats.remote()) for replica in executor.slots), return_exceptions=True
        )
        figures = service_step_metrics(executor_step, [r for r in replica_steps if isinstance(r, ScorerStats)])
        if self._sleep is not None:
            figures.update(self._sleep.pop())
        return figures

    async def sleep(self) -> dict[str, float]:
        """Put the replicas to sleep (``placement='policy_pool'``, before the policy's update): no new batch starts,
        the running ones end (at most ``batch_timeout_s``), then each replica moves its weights to host memory.
        Requests that arrive meanwhile wait for :meth:`wake` (their deadlines running). ``{"bytes", "seconds"}``;
        a no-op for a pool of its own, or when asleep."""
        executor, ledger = self._require(), self._sleep
        if ledger is None or ledger.asleep:
            return {"bytes": 0.0, "seconds": 0.0}
        start = time.monotonic()
        if not await executor.hold(self._batching.batch_timeout_s or DEFAULT_LATE_LIMIT_S):
            logger.warning("RM service %s: batches still running at the sleep; each replica sleeps after its call",
                           self._name)
        replicas = executor.slots
        answers = await self._each_replica("sleep", replicas)
        moved = 0.0
        for index, answer in enumerate(answers):
            if isinstance(answer, dict):
                moved += answer["bytes"]
            else:
                self._failed_sleep[index] = replicas[index]
                logger.error("RM service %s: replica %d did not sleep (%r); it is replaced at the wake",
                             self._name, index, answer)
        seconds = time.monotonic() - start
        ledger.slept(seconds, moved)
        return {"bytes": moved, "seconds": seconds}

    async def wake(self) -> dict[str, float]:
        """Wake the replicas (weights back on the device) and let batches start again; a replica that does not wake
        (it died asleep) is replaced as a replica lost in a batch is. ``{"bytes", "seconds"}``; a no-op when awake."""
        executor, ledger = self._require(), self._sleep
        if ledger is None or not ledger.asleep:
            return {"bytes": 0.0, "seconds": 0.0}
        start = time.monotonic()
        replicas = executor.slots
        answers = await self._each_replica("wake", replicas)
        moved = 0.0
        for index, answer in enumerate(answers):
            if isinstance(answer, dict) and self._failed_sleep.get(index) is not replicas[index]:
                moved += answer["bytes"]
                continue
            cause = answer if isinstance(answer, BaseException) else RuntimeError("it did not answer the sleep")
            if executor.lose_slot(index, ReplicaLostError(f"RM replica {index} did not wake: {cause!r}")):
                logger.error("RM service %s: replica %d did not wake (%r); replacing it", self._name, index, cause)
        self._failed_sleep.clear()
        executor.resume()
        seconds = time.monotonic() - start
        ledger.woke(seconds, moved)
        return {"bytes": moved, "seconds": seconds}

    async def _each_replica(self, method: str, replicas: tuple[Any, ...]) -> list[Any]:
        """``replica.<method>()`` on every replica at once, each within ``init_timeout_s`` (a wake reloads the
        weights): its answer, or the exception."""
        async def call(replica: Any) -> Any:
            return await asyncio.wait_for(getattr(replica, method).remote(), self._rm.init_timeout_s)

        return await asyncio.gather(*(call(r) for r in replicas), return_exceptions=True)

    async def score_batch(self, requests: list[RMRequest], timeout_s: float) -> list[float | Exception]:
        """Score a whole batch at once, the synchronous way (after rollout): contiguous, even chunks, one per replica,
        outside the batcher. One float or exception per request, in order; ``TimeoutError`` past ``timeout_s``."""
        replicas = self._require().slots
        bounds = [round(k * len(requests) / len(replicas)) for k in range(len(replicas) + 1)]
        chunks = [requests[bounds[k]: bounds[k + 1]] for k in range(len(replicas))]
        call = ReplicaCall(late_limit_s=DEFAULT_LATE_LIMIT_S)
        calls = [asyncio.ensure_future(call(chunk, replica)) for replica, chunk in zip(replicas, chunks, strict=True)]
        _, late = await asyncio.wait(calls, timeout=timeout_s)
        for task in late:  # not awaited: a cancelled call waits for its replica's late answer (kept, logged)
            task.cancel()
            self._abandoned.add(task)
            task.add_done_callback(self._forget)
        if late:
            raise TimeoutError(f"the RM replicas did not score a batch of {len(requests)} within {timeout_s:g}s")
        return [result for task in calls for result in task.result()]

    async def pop_batch_records(self) -> list[list[dict[str, float]]]:
        """Each current replica's scoring calls since the previous call (``{"start", "end", "size"}``, wall-clock
        seconds of the replica's host), in slot order (the demo's timeline)."""
        answers = await asyncio.gather(
            *(_bounded(replica.pop_batch_records.remote()) for replica in self._require().slots),
            return_exceptions=True,
        )
        return [a if isinstance(a, list) else [] for a in answers]

    async def stats(self) -> dict[str, Any]:
        """The batcher's counters and summaries since start (``PendingRequestExecutor.stats``)."""
        return self._require().stats()

    async def describe(self) -> list[dict[str, Any]]:
        """Each current replica's ``describe()`` (node, device, actor name, how its forwards run...), in slot order;
        a replica that does not answer shows ``{"error": ...}``."""
        answers = await asyncio.gather(
            *(_bounded(replica.describe.remote()) for replica in self._require().slots), return_exceptions=True
        )
        return [a if isinstance(a, dict) else {"error": repr(a)} for a in answers]

    async def close(self, grace_s: float = 10.0) -> None:
        """Fail waiting requests (``ExecutorClosedError``), give running batches ``grace_s``, kill the replicas and
        release the pool. Idempotent; the actor stays alive (the manager kills it)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            slots = executor.slots
            await executor.aclose(grace_s=grace_s)
            # stand-ins too (they are not in the rm_wg); gone when close returns
            await asyncio.to_thread(kill_and_wait, slots, _REPLICA_STOP_WAIT_S)
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(shutdown_rm_worker_group, group)

    async def ping(self) -> bool:
        """Readiness of the actor itself (True once constructed; :meth:`start` loads the RM)."""
        return True

    def _forget(self, task: asyncio.Task) -> None:
        self._abandoned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("RM service %s: a whole-batch call given up on ended with %r", self._name, task.exception())

    def _require(self) -> PendingRequestExecutor:
        if self._executor is None:
            raise AsyncRMError(f"RM service {self._name!r} is not started, or is closed")
        return self._executor


async def _bounded(ref: Any) -> Any:
    return await asyncio.wait_for(ref, _REPLICA_STATS_TIMEOUT_S)


def start_rm_service(rm: RMConfig, batching: BatchPolicy, *, name: str, **options: Any) -> Any:
    """Start an :class:`RMService` actor and wait (at most :func:`start_timeout_s`) until its RM is loaded; on any
    failure the actor is killed and the error raised. ``options``: those of :func:`launch_rm_service`."""
    service, started = launch_rm_service(rm, batching, name=name, **options)
    try:
        ray.get(started, timeout=start_timeout_s(rm))
    except BaseException:
        kill_quietly(service)
        raise
    return service


def launch_rm_service(
    rm: RMConfig,
    batching: BatchPolicy,
    *,
    name: str,
    replace_replicas: bool = True,
    max_concurrency: int = 100_000,
    actor_name: str | None = None,
    late_limit_s: float | None = None,
) -> tuple[Any, Any]:
    """Create an :class:`RMService` actor and call its ``start``, without waiting: ``(handle, start's ObjectRef)``.

    ``max_concurrency``: how many calls may wait in the actor at once (each waiting ``score`` holds one);
    ``actor_name``: a Ray actor name (default: unnamed).
    """
    options: dict[str, Any] = {"max_concurrency": max_concurrency, "num_cpus": 0}
    if actor_name is not None:
        options["name"] = actor_name
    # num_cpus=0: it only runs an event loop, and must not wait for a CPU that placement groups have reserved.
    service = ray.remote(RMService).options(**options).remote(rm, batching, name=name,
                                                              replace_replicas=replace_replicas,
                                                              late_limit_s=late_limit_s)
    return service, service.start.remote()


def start_timeout_s(rm: RMConfig) -> float:
    """Longest a service's ``start`` may take: the pool's placement, the RM's load, and a minute for the actor."""
    return rm.placement_timeout_s + rm.init_timeout_s + 60.0

