"""A thin Ray async actor around :class:`PendingRequestExecutor`, shared by every agent-loop worker.

Create it with :func:`create_executor_actor` (a named, async actor with a high ``max_concurrency`` so that thousands of
callers can wait at once). Every method is ``async`` and the actor never blocks its event loop: ``batch_fn`` must await
the ObjectRefs it gets from the RM replicas (``await slot.score.remote(...)``), never call ``ray.get``.

Callers must bound their wait. Either use :func:`submit_with_timeout`, which sets the executor-side deadline and a
client-side timeout (so a dead or stuck actor cannot hang the caller), or do the same by hand::

    ref = actor.submit.remote(item, num_tokens=n, deadline_s=30.0)
    score = await asyncio.wait_for(ref, timeout=32.0)

Exceptions raised in the actor reach the caller as ``ray.exceptions.RayTaskError`` subclasses that are also instances
of the original class, so ``except RequestTimeoutError`` / ``except QueueFullError`` work on the caller's side.

Ray is imported only inside these functions: importing this module does not start or require Ray.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from verl_async_rm.errors import RequestTimeoutError
from verl_async_rm.executor.core import BatchFn, PendingRequestExecutor
from verl_async_rm.executor.policy import BatchPolicy

__all__ = ["ExecutorActor", "create_executor_actor", "submit_with_timeout", "DEFAULT_MAX_CONCURRENCY"]

logger = logging.getLogger(__name__)

#: Concurrent calls the actor accepts; each waiting ``submit`` holds one.
DEFAULT_MAX_CONCURRENCY = 10_000


class ExecutorActor:
    """The executor as a Ray actor class (undecorated: :func:`create_executor_actor` applies ``ray.remote``).

    Args:
        batch_fn: a picklable async callable ``(items, slot) -> list`` (for example an object with
            ``async def __call__(self, items, slot)`` that awaits ``slot.score.remote(items)``).
        policy: a :class:`BatchPolicy` or a dict of its fields.
        slots: an int or a sequence of slot objects (for example RM replica actor handles).
        name: used in logs and error messages.
        replace_slot: a picklable ``async replace_slot(slot, index) -> new slot`` for lost slots (for example
            :class:`verl_async_rm.rm.ReplicaFactory`); None retires them.
    """

    def __init__(
        self,
        batch_fn: BatchFn,
        policy: BatchPolicy | Mapping[str, Any] | None = None,
        slots: int | Sequence[Any] = 1,
        name: str = "executor",
        replace_slot: Any = None,
    ) -> None:
        self._executor = PendingRequestExecutor(
            batch_fn, BatchPolicy.from_mapping(policy), slots=slots, name=name, replace_slot=replace_slot
        )

    async def submit(self, item: Any, num_tokens: int | None = None, deadline_s: float | None = None) -> Any:
        """:meth:`PendingRequestExecutor.submit`; a cancelled call (``ray.cancel``) leaves the queue."""
        return await self._executor.submit(item, num_tokens=num_tokens, deadline_s=deadline_s)

    async def drain(self) -> int:
        """:meth:`PendingRequestExecutor.drain`."""
        return self._executor.drain()

    async def expect(self, n: int) -> None:
        """:meth:`PendingRequestExecutor.expect`."""
        self._executor.expect(n)

    async def stats(self) -> dict[str, Any]:
        """:meth:`PendingRequestExecutor.stats` plus the policy."""
        out = self._executor.stats()
        out["policy"] = self._executor.policy.to_dict()
        return out

    async def pop_step_stats(self) -> dict[str, Any]:
        """:meth:`PendingRequestExecutor.pop_step_stats`."""
        return self._executor.pop_step_stats()

    async def aclose(self, grace_s: float = 10.0) -> None:
        """:meth:`PendingRequestExecutor.aclose`; the actor stays alive (kill it with ``ray.kill``)."""
        await self._executor.aclose(grace_s=grace_s)

    async def slots(self) -> list[Any]:
        """The current slot objects (a replaced slot shows its replacement), in slot order."""
        return list(self._executor.slots)

    async def ping(self) -> bool:
        """Readiness check: True once the actor is constructed."""
        return True


def create_executor_actor(
    batch_fn: BatchFn,
    policy: BatchPolicy | Mapping[str, Any] | None = None,
    slots: int | Sequence[Any] = 1,
    *,
    name: str | None = None,
    namespace: str | None = None,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    get_if_exists: bool = False,
    replace_slot: Any = None,
    **options: Any,
) -> Any:
    """Start an :class:`ExecutorActor` and return its handle.

    Args:
        batch_fn, policy, slots: as for :class:`ExecutorActor` (the policy is validated here, in the caller).
        name, namespace: make it a named actor other processes find with ``ray.get_actor(name, namespace=...)``.
        max_concurrency: how many calls may wait in the actor at once; keep it above the number of trajectories
            that can be waiting for a score (default 10,000).
        get_if_exists: return the running actor of that name instead of failing.
        replace_slot: see :class:`ExecutorActor`.
        options: more ``ActorClass.options(...)`` (``num_cpus`` defaults to 0: the actor only runs an event loop,
            and must not wait for a CPU that placement groups have reserved).

    Callers must put a timeout on every await (see :func:`submit_with_timeout`).
    """
    import ray

    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")
    checked = BatchPolicy.from_mapping(policy)
    opts: dict[str, Any] = {"max_concurrency": max_concurrency, "num_cpus": 0}
    opts.update(options)
    if name is not None:
        opts["name"] = name
        opts["get_if_exists"] = get_if_exists
    if namespace is not None:
        opts["namespace"] = namespace
    actor_cls = ray.remote(ExecutorActor)
    return actor_cls.options(**opts).remote(batch_fn, checked.to_dict(), slots, name or "executor", replace_slot)


async def submit_with_timeout(
    actor: Any,
    item: Any,
    *,
    timeout_s: float,
    num_tokens: int | None = None,
    deadline_s: float | None = None,
    transport_grace_s: float = 2.0,
) -> Any:
    """Submit ``item`` through an executor actor and wait at most about ``timeout_s`` for its result.

    The executor-side deadline is ``min(deadline_s, timeout_s)``, so a request that cannot be served in time leaves the
    queue and raises ``RequestTimeoutError`` from the actor. If the actor does not answer within
    ``timeout_s + transport_grace_s`` (dead, stuck, or unreachable), the call is cancelled and
    ``RequestTimeoutError`` is raised here. Other exceptions of the request propagate (as Ray task errors that are
    also instances of the original class); a dead actor raises ``ray.exceptions.RayActorError``.
    """
    import ray

    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    server_deadline = timeout_s if deadline_s is None else min(deadline_s, timeout_s)
    ref = actor.submit.remote(item, num_tokens=num_tokens, deadline_s=server_deadline)
    # Not asyncio.wait_for: the request's own RequestTimeoutError is a TimeoutError too (asyncio.TimeoutError is
    # TimeoutError since Python 3.11) and must reach the caller as it is, not as "the actor did not answer".
    answer = asyncio.ensure_future(_await(ref))
    try:
        done, _ = await asyncio.wait({answer}, timeout=timeout_s + transport_grace_s)
    except asyncio.CancelledError:  # the caller gave up: take the request out of the executor's queue too
        answer.cancel()
        _cancel_quietly(ray, ref)
        raise
    if done:
        return answer.result()
    answer.cancel()
    _cancel_quietly(ray, ref)
    raise RequestTimeoutError(
        f"the executor actor did not answer within {timeout_s + transport_grace_s:g} s "
        f"(timeout_s={timeout_s:g} + transport_grace_s={transport_grace_s:g}); is it alive?"
    )


async def _await(ref: Any) -> Any:
    return await ref


def _cancel_quietly(ray: Any, ref: Any) -> None:
    """Best effort: cancel a submit (the executor drops the request if it has not run yet); the actor may be gone."""
    try:
        ray.cancel(ref)
    except Exception as exc:  # noqa: BLE001
        logger.debug("could not cancel a submit: %r", exc)
