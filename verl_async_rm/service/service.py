"""``RMService``: one RM as a Ray actor that owns its replicas, batcher and statistics, for every kind and engine
alike: its replicas are Ray actors of the rm_wg (:class:`~.actors.ActorReplicas`) or, for an RM at an endpoint, the
slots of one endpoint client (:class:`~verl_async_rm.remote.slots.EndpointSlots`). Workers call only
:meth:`RMService.score`; the manager starts the services, marks steps and closes them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from verl_async_rm.errors import AsyncRMError, JudgeVerdictError, ReplicaLostError, ResourcePoolError, remote_cause
from verl_async_rm.remote.slots import EndpointSlots
from verl_async_rm.request import GroupRequest, RMRequest, ScoreResult
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.actors import ActorReplicas
from verl_async_rm.service.batcher import Batcher
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.service.group_gate import GroupGate
from verl_async_rm.service.metrics import service_step_metrics
from verl_async_rm.service.pairs import PAIR_COUNTS, judge_pairs, pair_metrics
from verl_async_rm.service.placement import kill_and_wait, kill_quietly, remove_pool_groups, replica_bundle
from verl_async_rm.step_counter import StepCounter

logger = logging.getLogger(__name__)

__all__ = ["RMService", "SleepStats", "start_rm_service", "launch_rm_service", "launch_rm_services",
           "wait_rm_services", "start_timeout_s", "check_pools_fit", "pools_text"]

#: Longest wait for one replica's control answer (step counters, describe) and for killed actors to be gone.
_CONTROL_S = 30.0
_POOLS_FIX = ("make a pool smaller (its n_gpus_per_node / nnodes), score with fewer RMs (async_rm.models.*), or give "
              "the cluster more GPUs")


class SleepStats:
    """Whether the replicas are awake (``placement='policy_pool'``), and the step's sleep and wake stats; time
    awake and asleep is split at each :meth:`pop` (a step's end)."""

    _FIGURES = ("rm_awake_s", "rm_asleep_s", "sleeps", "wakes", "sleep_s", "wake_s", "sleep_bytes", "wake_bytes")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock, self.asleep, self._since = clock, False, clock()
        self._counts = StepCounter(self._FIGURES)

    def _switch(self, asleep: bool) -> None:
        now = self._clock()
        self._counts.add("rm_asleep_s" if self.asleep else "rm_awake_s", now - self._since)
        self.asleep, self._since = asleep, now

    def slept(self, seconds: float, moved_bytes: float) -> None:
        self._add("sleep", seconds, moved_bytes)

    def woke(self, seconds: float, moved_bytes: float) -> None:
        self._add("wake", seconds, moved_bytes)

    def _add(self, what: str, seconds: float, moved_bytes: float) -> None:
        self._switch(what == "sleep")
        self._counts.add_all({f"{what}s": 1, f"{what}_s": seconds, f"{what}_bytes": moved_bytes})

    def pop(self) -> dict[str, float]:
        """The step's metrics (the ``async_rm/`` of the RM on the policy's GPUs), then starts over."""
        self._switch(self.asleep)
        step = {name: float(value) for name, value in self._counts.pop_step().items()}
        total = step["rm_awake_s"] + step["rm_asleep_s"]
        return {**step, "rm_awake_share": step["rm_awake_s"] / total if total > 0 else 1.0}


class RMService:
    """One RM as a Ray async actor (see :func:`start_rm_service`). ``name`` names the pool's placement groups, the
    replicas and the log lines (a service started again under the same name removes what its dead predecessor left).
    ``replace_replicas``: a new replica in the bundle of one that died, else it is retired. A group judge's requests
    wait in its :class:`~.group_gate.GroupGate` for their group, which the batcher then sees as one request. A judge's
    reply that does not read is asked again (:meth:`_ask`)."""

    def __init__(self, rm: RMConfig, batching: BatchPolicy, *, name: str, replace_replicas: bool = True) -> None:
        self._rm, self._batching, self._name = rm, batching, name
        #: The one place that asks where the RM runs: at an endpoint, or on replicas the plugin loads.
        self._replicas = EndpointSlots(rm, name) if rm.endpoint else ActorReplicas(rm, name, replace_replicas)
        self._batcher: Batcher[RMRequest | GroupRequest, ScoreResult] | None = None
        self._gate = (GroupGate(self._judge_group, wait_s=rm.group_wait_s, name=name)
                      if rm.grouped else None)
        self._reasks = StepCounter(["reasks"])
        #: A pairwise judge's comparisons this step (:mod:`.pairs`).
        self._pairs = StepCounter(PAIR_COUNTS) if rm.reward_kind == "pairwise_judge" else None
        self._sleep = SleepStats() if self._replicas.sleeps else None
        #: Replicas that did not answer the sleep, by index: lost at the wake if the index still holds them.
        self._failed_sleep: dict[int, Any] = {}

    async def start(self) -> list[dict[str, Any]]:
        """Start the replicas and the batcher; returns each replica's ``describe`` (raises what kept them from
        starting, after releasing what was reserved)."""
        if self._batcher is None:
            replicas = self._replicas
            await replicas.start()
            batching = replicas.batching(self._batching)
            self._batcher = Batcher(replicas.score, batching, replicas=replicas.handles, name=self._name,
                                    replace_replica=replicas.replace)
            logger.info("RM service %s: %d replica(s) of %s, batching %s", self._name, len(replicas.handles),
                        self._rm.endpoint or self._rm.model_path, batching)
        return await self.describe()

    async def score(self, request: RMRequest, deadline_s: float | None = None) -> ScoreResult:
        """The RM score of one trajectory, or, as a value, the error that kept it from being scored
        (``RequestTimeoutError`` past ``deadline_s``): the call itself raises only if this service is lost. A caller
        that gives up (``ray.cancel``) takes its request out of the queue (out of its group, for a group judge)."""
        if self._gate is not None:
            return await self._gate.submit(request, deadline_s)
        return await self._ask(request, deadline_s)

    async def _judge_group(self, group: GroupRequest, deadline_s: float | None) -> ScoreResult:
        """One group's judging (the gate's ``judge``): through the batcher, as one request, or for a pairwise judge
        as one request per comparison (:func:`~.pairs.judge_pairs`)."""
        if self._pairs is not None:
            return await judge_pairs(group, self._ask, self._rm, deadline_s, self._pairs)
        return await self._ask(group, deadline_s)

    async def _ask(self, item: RMRequest | GroupRequest, deadline_s: float | None) -> ScoreResult:
        """``item``'s result through the batcher, as a value. A judge's reply that does not read (or was cut) is asked
        again up to ``judge_retries`` times, with the reply and why it did not read (``reask``), while the deadline has
        not passed: the one rule for every judge, local or remote, per response or per group."""
        loop = asyncio.get_running_loop()
        end = None if deadline_s is None else loop.time() + deadline_s
        retries = self._rm.judge_retries if self._rm.writes else 0
        for asked in range(retries + 1):
            try:
                result = await self._require().submit(item, num_tokens=item.num_tokens,
                                                      deadline_s=None if end is None else end - loop.time())
            except AsyncRMError as err:
                return err
            if not (isinstance(result, JudgeVerdictError) and result.reply is not None and asked < retries
                    and (end is None or loop.time() < end)):
                return result
            self._reasks.add("reasks")
            item = dataclasses.replace(item, reask=(result.reply, result.reason or "it does not read"))
        raise AssertionError("unreachable: the last ask returns")

    async def withdraw(self, group: str, group_size: int | None) -> None:
        """A trajectory of ``group`` will never be scored here (its agent loop failed, or scored itself): a group
        judge judges its siblings without waiting for it (:meth:`GroupGate.withdraw`); other RMs have nothing to
        do."""
        if self._gate is not None:
            self._gate.withdraw(group, group_size)

    async def begin_step(self, step_size: int | None = None) -> None:
        """Start a step: its stats count from here (the replicas' too, so a first step holds no warm-up; the sleep
        stats run from one step's end to the next: a step's wake comes before its start); ``step_size``: see
        :meth:`flush_after`."""
        await self._pop_step(sleep=False)
        if step_size:
            await self.flush_after(int(step_size))

    async def flush_after(self, n: int) -> None:
        """``n`` more trajectories belong to this step: the last batch leaves the moment the last one arrives (a
        group judge's batches are groups, not trajectories: they leave by ``max_wait_ms``)."""
        if self._gate is None:
            self._require().flush_after(int(n))

    async def end_step(self) -> dict[str, float]:
        """End a step: flush what waits and return the step's metrics (``service_step_metrics``, with the replicas'
        own counters and, at an endpoint, the client's)."""
        self._require().flush()
        return await self._pop_step()

    async def _pop_step(self, sleep: bool = True) -> dict[str, float]:
        batcher, replicas = self._require(), self._replicas
        # every count of the step is taken before the replicas' stats are awaited: what ends meanwhile is the next's
        step = batcher.pop_step_stats()
        group = None if self._gate is None else self._gate.pop_step_stats()
        reasks = int(self._reasks.pop_step()["reasks"])
        pairs = None if self._pairs is None else self._pairs.pop_step()
        metrics = service_step_metrics(step, await replicas.step_stats(batcher.replicas, _CONTROL_S), group, reasks)
        if pairs is not None:
            metrics.update({k: float(v) for k, v in pair_metrics(pairs, group.requests).items() if v is not None})
        metrics.update(replicas.step_metrics())
        if self._sleep is not None and sleep:
            metrics.update(self._sleep.pop())
        return metrics

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
        for index, answer in enumerate(await self._replicas.each(replicas, "sleep", self._rm.init_timeout_s)):
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
        for index, answer in enumerate(await self._replicas.each(replicas, "wake", self._rm.init_timeout_s)):
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
        """The batcher's counters and summaries since start (:meth:`Batcher.stats`), a group judge's groups waiting
        (:meth:`GroupGate.stats`) and, at an endpoint, the client's counters under ``endpoint``."""
        return {**self._require().stats(), **({} if self._gate is None else self._gate.stats()),
                **self._replicas.stats()}

    async def describe(self) -> list[dict[str, Any]]:
        """Each current replica's ``describe()``, in order; one that does not answer shows ``{"error": ...}``."""
        return await self._replicas.describe(self._require().replicas, _CONTROL_S)

    async def close(self, grace_s: float = 10.0) -> None:
        """Fail waiting requests, give running batches ``grace_s``, then stop the replicas (kill them and release the
        pool, or close the endpoint client). Idempotent; the actor stays alive (the manager kills it)."""
        if self._gate is not None:  # its members fail, its judge calls get grace_s (they are the batcher's requests)
            await self._gate.aclose(grace_s=grace_s)
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            handles = list(batcher.replicas)
            await batcher.aclose(grace_s=grace_s)
            await self._replicas.close(handles, _CONTROL_S)

    async def ping(self) -> bool:
        return True

    def _require(self) -> Batcher[RMRequest | GroupRequest, ScoreResult]:
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
                      max_concurrency: int = 100_000) -> tuple[Any, Any]:
    """Create an :class:`RMService` actor and call its ``start`` without waiting: ``(handle, start's ObjectRef)``.
    ``max_concurrency``: how many calls may wait in the actor at once (each waiting ``score`` holds one)."""
    # num_cpus=0: it only runs an event loop, and must not wait for a CPU that placement groups have reserved
    service = ray.remote(RMService).options(max_concurrency=max_concurrency, num_cpus=0).remote(
        rm, batching, name=name, replace_replicas=replace_replicas)
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
        if not entry.rm.own_pool:  # in verl's policy bundles, or served elsewhere
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
    for e in (e for e in entries if e.rm.own_pool):
        unit, n, k = "GPU" if e.rm.use_gpu else "CPU", e.rm.num_replicas, e.rm.gpus_per_replica
        shape = (f"{n} {unit} bundle{'s' if n > 1 else ''}" if k == 1 else
                 f"{n * k} {unit}s: {n} replica{'s' if n > 1 else ''} of "
                 f"{e.key if e.key.startswith('async_rm') else 'async_rm'}.gpus_per_replica={k}")
        parts.append(f"RM {e.name!r}: {e.key}.n_gpus_per_node={e.rm.n_gpus_per_node} x {e.key}.nnodes="
                     f"{e.rm.nnodes} ({shape})")
    return "; ".join(parts)


def _amounts(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items())
