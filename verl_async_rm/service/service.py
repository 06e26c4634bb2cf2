"""``RMService``: one RM as a Ray actor that owns its pool, replicas, batcher and statistics. Workers call only
:meth:`RMService.score`; the manager starts the services, marks steps and closes them."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from verl_async_rm.errors import (AsyncRMError, JudgeVerdictError, ReplicaLostError, ResourcePoolError,
                                  RewardModelError, remote_cause)
from verl_async_rm.request import GroupRequest, RMRequest, ScoreResult
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.scorer import ScorerStats
from verl_async_rm.service.batcher import Batcher
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.service.group_gate import GroupGate
from verl_async_rm.service.metrics import service_step_metrics
from verl_async_rm.service.placement import (ReplicaFactory, create_rm_worker_group, kill_and_wait, kill_quietly,
                                             remove_pool_groups, replica_bundle, shutdown_rm_worker_group)
from verl_async_rm.service.remote_service import RemoteRMService

logger = logging.getLogger(__name__)

__all__ = ["RMService", "call_replica", "SleepStats", "start_rm_service", "launch_rm_service", "launch_rm_services",
           "wait_rm_services", "start_timeout_s", "check_pools_fit", "pools_text"]

#: Longest wait for one replica's control answer (step counters, describe) and for killed actors to be gone.
_CONTROL_S = 30.0
_POOLS_FIX = ("make a pool smaller (its n_gpus_per_node / nnodes), score with fewer RMs (async_rm.models.*), or give "
              "the cluster more GPUs")


async def call_replica(items: Sequence[RMRequest], replica: Any, *, grace_s: float) -> list[ScoreResult]:
    """``replica.score(items)``, the RM service's ``batch_fn``: one result per item. The call raises only when the
    replica cannot answer for the whole batch: a dead one :class:`ReplicaLostError` (the batcher re-queues the batch and
    replaces it), a typed error as it is, any other as :class:`RewardModelError` (its cause kept). A replica cannot be
    interrupted: a call the batcher cancelled (timed out) waits ``grace_s`` for its answer, then the replica is
    lost."""
    if not items:
        return []
    answer = asyncio.wrap_future(replica.score.remote(list(items)).future())
    try:
        return await asyncio.shield(answer)
    except asyncio.CancelledError:
        done, _ = await asyncio.wait({answer}, timeout=grace_s)
        if not done:
            answer.cancel()
            raise ReplicaLostError(f"RM replica still had not answered a batch of {len(items)} {grace_s:g}s after it "
                                   "timed out; treating it as lost") from None
        if not answer.cancelled() and isinstance(answer.exception(), ray.exceptions.RayActorError):
            raise ReplicaLostError(f"RM replica died during a timed-out call: {answer.exception()}") from None
        raise
    except ray.exceptions.RayActorError as err:
        raise ReplicaLostError(f"RM replica is gone: {err}") from err
    except ray.exceptions.RayError as err:
        cause = remote_cause(err)  # Ray's wrapper removed here, once; the cause keeps its own __cause__
        if isinstance(cause, AsyncRMError):
            raise cause from cause.__cause__
        raise RewardModelError(f"RM replica failed on a batch of {len(items)}: {cause!r}") from cause


class SleepStats:
    """Whether the replicas are awake (``placement='policy_pool'``), and the step's sleep and wake figures; time
    awake and asleep is split at each :meth:`pop` (a step's end)."""

    _FIGURES = ("rm_awake_s", "rm_asleep_s", "sleeps", "wakes", "sleep_s", "wake_s", "sleep_bytes", "wake_bytes")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock, self.asleep, self._since = clock, False, clock()
        self._step = dict.fromkeys(self._FIGURES, 0.0)

    def _switch(self, asleep: bool) -> None:
        now = self._clock()
        self._step["rm_asleep_s" if self.asleep else "rm_awake_s"] += now - self._since
        self.asleep, self._since = asleep, now

    def slept(self, seconds: float, moved_bytes: float) -> None:
        self._add("sleep", seconds, moved_bytes)

    def woke(self, seconds: float, moved_bytes: float) -> None:
        self._add("wake", seconds, moved_bytes)

    def _add(self, what: str, seconds: float, moved_bytes: float) -> None:
        self._switch(what == "sleep")
        self._step[f"{what}s"] += 1
        self._step[f"{what}_s"] += seconds
        self._step[f"{what}_bytes"] += moved_bytes

    def pop(self) -> dict[str, float]:
        """The step's figures (the ``async_rm/`` metrics of the RM on the policy's GPUs), then starts over."""
        self._switch(self.asleep)
        step, self._step = self._step, dict.fromkeys(self._FIGURES, 0.0)
        total = step["rm_awake_s"] + step["rm_asleep_s"]
        return {**step, "rm_awake_share": step["rm_awake_s"] / total if total > 0 else 1.0}


class RMService:
    """One RM as a Ray async actor (see :func:`start_rm_service`). ``name`` names the pool's placement groups, the
    replicas and the log lines (a service started again under the same name removes what its dead predecessor left).
    ``replace_replicas``: a new replica in the bundle of one that died, else it is retired. A group judge's requests
    wait in its :class:`~.group_gate.GroupGate` for their group, which the batcher then sees as one request."""

    def __init__(self, rm: RMConfig, batching: BatchPolicy, *, name: str, replace_replicas: bool = True) -> None:
        self._rm, self._batching, self._name, self._replace = rm, batching, name, replace_replicas
        self._group: Any = None
        self._batcher: Batcher | None = None
        self._gate = (GroupGate(self._judge_group, wait_s=rm.group_wait_s, retries=rm.judge_retries, name=name)
                      if rm.reward_kind == "group_judge" else None)
        self._reasks = 0  #: this step's re-asks of a per-response judge
        self._sleep = SleepStats() if rm.placement == "policy_pool" else None
        #: Replicas that did not answer the sleep, by index: lost at the wake if the index still holds them.
        self._failed_sleep: dict[int, Any] = {}

    async def start(self) -> list[dict[str, Any]]:
        """Reserve the pool, load the RM on every replica and start the batcher; returns each replica's ``describe``
        (raises what kept them from starting, after releasing what was reserved)."""
        if self._batcher is not None:
            return await self.describe()
        # placement and loading block on Ray calls: a thread keeps this actor's loop free meanwhile
        self._group = await asyncio.to_thread(create_rm_worker_group, self._rm, None, f"{self._name}_")
        # a timed-out call gets as long as a replacement replica would take to load before its replica is replaced
        call = functools.partial(call_replica, grace_s=self._rm.init_timeout_s)
        self._batcher = Batcher(call, self._batching, replicas=list(self._group.workers), name=self._name,
                                replace_replica=ReplicaFactory(self._rm, self._group) if self._replace else None)
        logger.info("RM service %s: %d replica(s) of %s, batching %s", self._name, self._rm.num_replicas,
                    self._rm.model_path, self._batching)
        return await self.describe()

    async def score(self, request: RMRequest, deadline_s: float | None = None) -> ScoreResult:
        """The RM score of one trajectory, or, as a value, the error that kept it from being scored
        (``RequestTimeoutError`` past ``deadline_s``): the call itself raises only if this service is lost. A caller
        that gives up (``ray.cancel``) takes its request out of the queue (out of its group, for a group judge). A
        judge's reply that does not read is asked again up to ``judge_retries`` times, with the reply and why it did
        not read (:attr:`RMRequest.reask`)."""
        try:
            batcher = self._require()
        except AsyncRMError as err:
            return err
        if self._gate is not None:
            return await self._gate.submit(request, deadline_s)
        loop = asyncio.get_running_loop()
        end = None if deadline_s is None else loop.time() + deadline_s
        retries = self._rm.judge_retries if self._rm.writes else 0
        for asked in range(retries + 1):
            left = None if end is None else end - loop.time()
            try:
                result = await batcher.submit(request, num_tokens=request.num_tokens, deadline_s=left)
            except AsyncRMError as err:
                result = err
            if not (isinstance(result, JudgeVerdictError) and result.reply is not None and asked < retries
                    and (end is None or end > loop.time())):
                return result
            self._reasks += 1
            request = dataclasses.replace(request, reask=(result.reply, result.reason or "it does not read"))
        raise AssertionError("unreachable: the last ask returns")

    async def withdraw(self, group: str, group_size: int | None) -> None:
        """A trajectory of ``group`` will never be scored here (its agent loop failed, or scored itself): a group
        judge judges its siblings without waiting for it (:meth:`GroupGate.withdraw`); other RMs have nothing to
        do."""
        if self._gate is not None:
            self._gate.withdraw(group, group_size)

    async def _judge_group(self, group: GroupRequest, deadline_s: float | None) -> ScoreResult:
        """One judge call for a group (the gate's ``judge``): through the batcher, as one request."""
        try:
            return await self._require().submit(group, num_tokens=group.num_tokens, deadline_s=deadline_s)
        except AsyncRMError as err:
            return err

    async def begin_step(self, step_size: int | None = None) -> None:
        """Start a step: its figures count from here; ``step_size``: see :meth:`flush_after`."""
        self._require().pop_step_stats()
        self._reasks = 0
        if self._gate is not None:
            self._gate.pop_step_stats()
        if step_size:
            await self.flush_after(int(step_size))

    async def flush_after(self, n: int) -> None:
        """``n`` more trajectories belong to this step: the last batch leaves the moment the last one arrives (a
        group judge's batches are groups, not trajectories: they leave by ``max_wait_ms``)."""
        if self._gate is None:
            self._require().flush_after(int(n))

    async def end_step(self) -> dict[str, float]:
        """End a step: flush what waits and return the step's figures (``service_step_metrics``), with the
        replicas' own counters (a replica that does not answer in time is left out)."""
        batcher = self._require()
        batcher.flush()
        step = batcher.pop_step_stats()
        answers = await self._each_replica("pop_step_stats", _CONTROL_S)
        reasks, self._reasks = self._reasks, 0
        figures = service_step_metrics(step, [a for a in answers if isinstance(a, ScorerStats)],
                                       None if self._gate is None else self._gate.pop_step_stats(), reasks)
        if self._sleep is not None:
            figures.update(self._sleep.pop())
        return figures

    async def sleep(self) -> dict[str, float]:
        """Put the replicas to sleep (``placement='policy_pool'``, before the policy's update): no batch starts, the
        running ones end (at most ``batch_timeout_s``), then each replica moves its weights to host memory. Requests
        that arrive meanwhile wait for :meth:`wake`. ``{"bytes", "seconds"}``; a no-op otherwise."""
        batcher, stats = self._require(), self._sleep
        if stats is None or stats.asleep:
            return {"bytes": 0.0, "seconds": 0.0}
        start = time.monotonic()
        if not await batcher.pause(self._batching.batch_timeout_s or self._rm.init_timeout_s):
            logger.warning("RM service %s: batches still running at the sleep; each replica sleeps after its call",
                           self._name)
        replicas = list(batcher.replicas)
        moved = 0.0
        for index, answer in enumerate(await self._each_replica("sleep", self._rm.init_timeout_s)):
            if isinstance(answer, dict):
                moved += answer["bytes"]
            else:
                self._failed_sleep[index] = replicas[index]
                logger.error("RM service %s: replica %d did not sleep (%r); it is replaced at the wake", self._name,
                             index, answer)
        stats.slept(time.monotonic() - start, moved)
        return {"bytes": moved, "seconds": time.monotonic() - start}

    async def wake(self) -> dict[str, float]:
        """Wake the replicas and let batches start again; one that does not wake (it died asleep) is replaced as a
        replica lost in a batch is. ``{"bytes", "seconds"}``; a no-op when awake."""
        batcher, stats = self._require(), self._sleep
        if stats is None or not stats.asleep:
            return {"bytes": 0.0, "seconds": 0.0}
        start = time.monotonic()
        replicas = list(batcher.replicas)
        moved = 0.0
        for index, answer in enumerate(await self._each_replica("wake", self._rm.init_timeout_s)):
            if isinstance(answer, dict) and self._failed_sleep.get(index) is not replicas[index]:
                moved += answer["bytes"]
                continue
            cause = answer if isinstance(answer, BaseException) else RuntimeError("it did not answer the sleep")
            if batcher.lose_replica(index, ReplicaLostError(f"RM replica {index} did not wake: {cause!r}")):
                logger.error("RM service %s: replica %d did not wake (%r); replacing it", self._name, index, cause)
        self._failed_sleep.clear()
        batcher.resume()
        stats.woke(time.monotonic() - start, moved)
        return {"bytes": moved, "seconds": time.monotonic() - start}

    async def stats(self) -> dict[str, Any]:
        """The batcher's counters and summaries since start (:meth:`Batcher.stats`), and a group judge's groups
        waiting (:meth:`GroupGate.stats`)."""
        return {**self._require().stats(), **({} if self._gate is None else self._gate.stats())}

    async def describe(self) -> list[dict[str, Any]]:
        """Each current replica's ``describe()``, in order; one that does not answer shows ``{"error": ...}``."""
        answers = await self._each_replica("describe", _CONTROL_S)
        return [a if isinstance(a, dict) else {"error": repr(a)} for a in answers]

    async def close(self, grace_s: float = 10.0) -> None:
        """Fail waiting requests, give running batches ``grace_s``, kill the replicas and release the pool.
        Idempotent; the actor stays alive (the manager kills it)."""
        if self._gate is not None:  # its members fail, its judge calls get grace_s (they are the batcher's requests)
            await self._gate.aclose(grace_s=grace_s)
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            replicas = list(batcher.replicas)
            await batcher.aclose(grace_s=grace_s)
            await asyncio.to_thread(kill_and_wait, replicas, _CONTROL_S)  # replacements too (not in the rm_wg)
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(shutdown_rm_worker_group, group)

    async def ping(self) -> bool:
        return True

    async def _each_replica(self, method: str, timeout_s: float) -> list[Any]:
        """``replica.<method>()`` on every replica at once: each answer, or the exception."""
        async def call(replica: Any) -> Any:
            return await asyncio.wait_for(getattr(replica, method).remote(), timeout_s)

        return await asyncio.gather(*(call(r) for r in self._require().replicas), return_exceptions=True)

    def _require(self) -> Batcher:
        if self._batcher is None:
            raise AsyncRMError(f"RM service {self._name!r} is not started, or is closed")
        return self._batcher


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


def launch_rm_service(rm: RMConfig, batching: BatchPolicy, *, name: str, replace_replicas: bool = True,
                      max_concurrency: int = 100_000, actor_name: str | None = None) -> tuple[Any, Any]:
    """Create an :class:`RMService` actor and call its ``start`` without waiting: ``(handle, start's ObjectRef)``.
    ``max_concurrency``: how many calls may wait in the actor at once (each waiting ``score`` holds one)."""
    # num_cpus=0: it only runs an event loop, and must not wait for a CPU that placement groups have reserved
    options: dict[str, Any] = {"max_concurrency": max_concurrency, "num_cpus": 0}
    if actor_name is not None:
        options["name"] = actor_name
    kind = RemoteRMService if rm.remote else RMService
    service = ray.remote(kind).options(**options).remote(rm, batching, name=name, replace_replicas=replace_replicas)
    return service, service.start.remote()


def start_timeout_s(rm: RMConfig) -> float:
    """Longest a service's ``start`` may take: the pool's placement, the RM's load, and a minute for the actor."""
    return rm.placement_timeout_s + rm.init_timeout_s + 60.0


def launch_rm_services(entries: Sequence[Any], names: Mapping[str, str], *, replace_replicas: bool,
                       max_concurrency: int) -> dict[str, tuple[Any, Any]]:
    """Check that the pools fit (``ValueError`` if not), then create every RM's service and call its ``start``
    without waiting: ``{rm name: (handle, start's ObjectRef)}``, for :func:`wait_rm_services`."""
    check_pools_fit(entries)
    return {e.name: launch_rm_service(e.rm, e.batching, name=names[e.name], replace_replicas=replace_replicas,
                                      max_concurrency=max_concurrency) for e in entries}


def wait_rm_services(entries: Sequence[Any], names: Mapping[str, str], launched: Mapping[str, tuple[Any, Any]]
                     ) -> None:
    """Wait until every launched RM is loaded. Raises ``ValueError`` when the pools could not be reserved within
    ``placement_timeout_s``, else what kept an RM from starting, noted with its name; then every service is stopped
    and its pool released."""
    deadline = time.monotonic() + max(start_timeout_s(e.rm) for e in entries)
    failure: BaseException | None = None
    for entry in entries:
        try:
            ray.get(launched[entry.name][1], timeout=max(1.0, deadline - time.monotonic()))
        except BaseException as err:  # noqa: BLE001 - every service is stopped, then the first failure raised
            if failure is None:
                err.add_note(f"while starting RM {entry.name!r} ({entry.key})")
                failure = err
    if failure is None:
        return
    for entry in entries:  # the replicas go with their service; placement groups live as long as the job
        kill_and_wait([launched[entry.name][0]], _CONTROL_S)
        remove_pool_groups(f"{names[entry.name]}_", entry.rm.nnodes)
    cause = remote_cause(failure)
    if isinstance(cause, ResourcePoolError):
        notes = "".join(f" ({note})" for note in getattr(failure, "__notes__", ()))
        raise ValueError(f"the RM pools could not be reserved: {pools_text(entries)}. The first failure{notes}: "
                         f"{cause}. Fix: {_POOLS_FIX}") from failure
    raise failure


def check_pools_fit(entries: Sequence[Any]) -> None:
    """Raise ``ValueError`` when the pools ask more, in total, than the cluster has free now."""
    need: dict[str, float] = {}
    for entry in entries:
        if entry.rm.placement == "policy_pool" or entry.rm.remote:  # in verl's policy bundles, or served elsewhere
            continue
        for resource, amount in replica_bundle(entry.rm.gpus_per_replica, entry.rm.use_gpu).items():
            need[resource] = need.get(resource, 0.0) + amount * entry.rm.num_replicas
    free, total = ray.available_resources(), ray.cluster_resources()
    if any(free.get(r, 0.0) + 1e-9 < amount for r, amount in need.items()):
        raise ValueError(
            f"the RM pools do not fit in the cluster: {pools_text(entries)}; together they need {_amounts(need)}, "
            f"and the cluster has {_amounts({r: free.get(r, 0.0) for r in need})} free "
            f"({_amounts({r: total.get(r, 0.0) for r in need})} in all). Fix: {_POOLS_FIX}")


def pools_text(entries: Sequence[Any]) -> str:
    """Each pool by its keys and size, e.g. ``async_rm.models.safety.n_gpus_per_node=1 x nnodes=1 (1 GPU)``."""
    parts = []
    for e in (e for e in entries if not e.rm.remote):
        unit, n, k = "GPU" if e.rm.use_gpu else "CPU", e.rm.num_replicas, e.rm.gpus_per_replica
        shape = (f"{n} {unit} bundle{'s' if n > 1 else ''}" if k == 1 else
                 f"{n * k} {unit}s: {n} replica{'s' if n > 1 else ''} of "
                 f"{e.key if e.key.startswith('async_rm') else 'async_rm'}.gpus_per_replica={k}")
        parts.append(f"RM {e.name!r}: {e.key}.n_gpus_per_node={e.rm.n_gpus_per_node} x {e.key}.nnodes="
                     f"{e.rm.nnodes} ({shape})")
    return "; ".join(parts)


def _amounts(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items())
