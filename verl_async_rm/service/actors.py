"""The replicas of an RM the plugin loads, for its RM service: Ray actors of the rm_wg on the reward pool (or in the
policy's bundles), one batch at a time each. :meth:`ActorReplicas.score` (:func:`call_replica`) is the batcher's
``batch_fn``; a replica that dies is replaced in its own bundle (:class:`~.placement.ReplicaFactory`), or retired."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Sequence
from typing import Any

import ray

from verl_async_rm.errors import AsyncRMError, ReplicaLostError, RewardModelError, remote_cause
from verl_async_rm.request import RMRequest, ScoreResult
from verl_async_rm.scoring.batch import ScorerStats
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.service.placement import (ReplicaFactory, create_rm_worker_group, kill_and_wait,
                                             shutdown_rm_worker_group)

__all__ = ["ActorReplicas", "call_replica"]


async def call_replica(items: Sequence[RMRequest], replica: Any, deadline: float = math.inf, *,
                       grace_s: float) -> list[ScoreResult]:
    """``replica.score(items)``: one result per item. The call raises only when the replica cannot answer for the
    whole batch: a dead one :class:`ReplicaLostError` (the batcher re-queues the batch and replaces it), a typed error
    as it is, any other as :class:`RewardModelError` (its cause kept). A replica cannot be interrupted, so
    ``deadline`` is not passed on: a call the batcher cancelled (timed out) waits ``grace_s`` for its answer, then
    the replica is lost."""
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
            raise ReplicaLostError(f"RM replica died during a timed-out call: {answer.exception()}") from \
                answer.exception()
        raise
    except ray.exceptions.RayActorError as err:
        raise ReplicaLostError(f"RM replica is gone: {err}") from err
    except ray.exceptions.RayError as err:
        cause = remote_cause(err)  # Ray's wrapper removed here, once; the cause keeps its own __cause__
        if isinstance(cause, AsyncRMError):
            raise cause from cause.__cause__
        raise RewardModelError(f"RM replica failed on a batch of {len(items)}: {cause!r}") from cause


class ActorReplicas:
    """The rm_wg of one RM (see the module doc). The calls that ask every replica take the batcher's current list
    (``handles``: replacements included)."""

    def __init__(self, rm: RMConfig, name: str, replace: bool = True) -> None:
        self.rm, self.name, self._replace = rm, name, replace
        #: The replicas sleep while the policy trains (on the policy's GPUs).
        self.sleeps = rm.sleeps
        self.handles: list[Any] = []
        self.replace: ReplicaFactory | None = None
        self._group: Any = None
        # a timed-out call gets as long as a replacement replica would take to load before its replica is replaced
        self.score = functools.partial(call_replica, grace_s=rm.init_timeout_s)

    def batching(self, policy: BatchPolicy) -> BatchPolicy:
        """How the batcher feeds the replicas: as ``policy`` says (a call that hangs ends at ``batch_timeout_s``)."""
        return policy

    async def start(self) -> None:
        """Reserve the pool and load the RM on every replica (raises what kept them from starting, after releasing
        what was reserved)."""
        # placement and loading block on Ray calls: a thread keeps the service's loop free meanwhile
        self._group = await asyncio.to_thread(create_rm_worker_group, self.rm, None, f"{self.name}_")
        self.handles = list(self._group.workers)
        self.replace = ReplicaFactory(self.rm, self._group) if self._replace else None

    async def each(self, handles: Sequence[Any], method: str, timeout_s: float) -> list[Any]:
        """``replica.<method>()`` on every replica at once: each answer, or the exception."""
        async def call(replica: Any) -> Any:
            return await asyncio.wait_for(getattr(replica, method).remote(), timeout_s)

        return await asyncio.gather(*(call(r) for r in handles), return_exceptions=True)

    async def step_stats(self, handles: Sequence[Any], timeout_s: float) -> list[ScorerStats]:
        """Each replica's counters since the last call (a replica that does not answer in time is left out)."""
        return [a for a in await self.each(handles, "pop_step_stats", timeout_s) if isinstance(a, ScorerStats)]

    def step_metrics(self) -> dict[str, float]:
        return {}

    def stats(self) -> dict[str, Any]:
        return {}

    async def describe(self, handles: Sequence[Any], timeout_s: float) -> list[dict[str, Any]]:
        """Each replica's ``describe()``, in order; one that does not answer shows ``{"error": ...}``."""
        return [a if isinstance(a, dict) else {"error": repr(a)} for a in await self.each(handles, "describe",
                                                                                         timeout_s)]

    async def close(self, handles: Sequence[Any], timeout_s: float) -> None:
        """Kill the replicas (replacements too: they are not in the rm_wg) and release the pool."""
        await asyncio.to_thread(kill_and_wait, list(handles), timeout_s)
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(shutdown_rm_worker_group, group)
