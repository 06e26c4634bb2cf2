"""Run the scheduling policies of the overlap benchmark on one workload, one after another, in this process.

Every policy gets the same :class:`~verl_async_rm.bench.workload.Workload` (trajectory ``i`` is handed over at
``finish_s[i]``) and the same :class:`~verl_async_rm.bench.simrm.SimulatedRM` on ``R`` replicas:

* ``sync``: wait for the last trajectory, then score everything: sorted longest first, cut into ``max_batch_size``
  batches, each batch to the first free replica (the best a score-after-rollout scheduler does; see ``bound``).
* ``per-request``: the real :class:`~verl_async_rm.service.batcher.Batcher` with ``max_batch_size=1,
  max_wait_ms=0``: every trajectory is its own RM call, as soon as a replica is free.
* ``eager``: the same batcher with ``max_wait_ms=0``: a replica that frees takes whatever is queued (up to the cap),
  never waiting for a batch to fill, and nothing is told about the end of the step.
* ``async``: the same batcher with this package's defaults (``BatchPolicy()``; ``--max-batch-size`` and
  ``--max-wait-ms`` override them for every policy) and ``flush_after(B)`` at the start of the step, which is what
  the verl integration does (the manager announces each step's trajectory count, so the last batch flushes at once).

Clocks: ``real`` runs on the stock asyncio loop with workload time scaled by ``scale`` real seconds per workload
second (``max_wait_ms`` is scaled the same way, so the policy sees the same workload-time wait); timer lateness and
the batcher's own overhead are thus measured, magnified by ``1 / scale``. ``virtual`` runs on
:func:`~verl_async_rm.testing.batcher.run_virtual` (time jumps to the next timer; deterministic; scale 1): it measures
the scheduling decisions alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from verl_async_rm.bench.bound import sync_batches
from verl_async_rm.bench.simrm import Clock, Item, SimulatedRM, policy_metrics
from verl_async_rm.bench.workload import RMCostModel, Workload
from verl_async_rm.service.batcher import Batcher
from verl_async_rm.service.batching import BatchPolicy

__all__ = ["POLICIES", "batcher_policies", "run_policies"]

logger = logging.getLogger(__name__)

#: The policies that run, in order (``bound`` is computed, see :mod:`verl_async_rm.bench.bound`).
POLICIES = ("sync", "per-request", "eager", "async")

_TIMEOUT_FACTOR = 10.0  # hang detector: a policy may take at most this many times the sync prediction (+60 s)


def batcher_policies(max_batch_size: int | None, max_wait_ms: float | None,
                      prefer_siblings: bool = False) -> dict[str, BatchPolicy]:
    """The batcher policies in workload time: ``async`` is ``BatchPolicy()`` with the given overrides."""
    defaults = BatchPolicy()
    cap = defaults.max_batch_size if max_batch_size is None else max_batch_size
    wait = defaults.max_wait_ms if max_wait_ms is None else max_wait_ms
    return {
        "per-request": BatchPolicy(max_batch_size=1, max_wait_ms=0.0),
        "eager": BatchPolicy(max_batch_size=cap, max_wait_ms=0.0),
        "async": dataclasses.replace(defaults, max_batch_size=cap, max_wait_ms=wait, prefer_siblings=prefer_siblings),
    }


async def _run_sync(workload: Workload, rm: SimulatedRM, clock: Clock, replicas: int, cap: int) -> list[Item]:
    items = [Item(i, t, group=workload.group(i)) for i, t in enumerate(workload.tokens)]

    async def arrive(item: Item) -> None:
        await clock.sleep_until(workload.finish_s[item.index])
        item.ready_s = clock.now()

    await asyncio.gather(*(arrive(item) for item in items))
    queue = deque(sync_batches(workload.tokens, cap))

    async def serve(replica: int) -> None:
        while queue:
            batch = [items[i] for i in queue.popleft()]
            result = await rm(batch, replica, math.inf)
            done = clock.now()
            for item, value in zip(batch, result, strict=True):
                if value != item.index:
                    raise RuntimeError(f"sync: trajectory {item.index} got the score of {value}")
                item.scored_s = done

    await asyncio.gather(*(serve(replica) for replica in range(replicas)))
    return items


async def _run_batcher(workload: Workload, rm: SimulatedRM, clock: Clock, replicas: int, policy: BatchPolicy,
                        expect: bool) -> list[Item]:
    real_policy = dataclasses.replace(policy, max_wait_ms=policy.max_wait_ms * clock.scale)
    batcher = Batcher(rm, real_policy, replicas=replicas, name="bench")
    items = [Item(i, t, group=workload.group(i)) for i, t in enumerate(workload.tokens)]

    async def arrive(item: Item) -> None:
        await clock.sleep_until(workload.finish_s[item.index])
        item.ready_s = clock.now()
        value = await batcher.submit(item, num_tokens=item.tokens)
        item.scored_s = clock.now()
        if value != item.index:
            raise RuntimeError(f"trajectory {item.index} got the score of {value}")

    try:
        if expect:
            batcher.flush_after(len(items))
        await asyncio.gather(*(arrive(item) for item in items))
        stats = batcher.stats()
    finally:
        await batcher.aclose()
    if stats["failed"] or stats["timed_out"] or stats["loop_restarts"]:
        raise RuntimeError(f"batcher run was not clean: {stats}")
    return items


async def _one(name: str, workload: Workload, cost: RMCostModel, scale: float, replicas: int,
               policies: dict[str, BatchPolicy], timeout_s: float) -> dict[str, Any]:
    clock = Clock(scale)
    rm = SimulatedRM(cost, clock)
    run: Awaitable[list[Item]]
    if name == "sync":
        run = _run_sync(workload, rm, clock, replicas, policies["async"].max_batch_size)
    else:
        run = _run_batcher(workload, rm, clock, replicas, policies[name], expect=name == "async")
    items = await asyncio.wait_for(run, timeout_s * scale)
    return policy_metrics(items, rm.batches, replicas)


def run_policies(
    workload: Workload,
    cost: RMCostModel,
    *,
    replicas: int,
    policies: dict[str, BatchPolicy],
    clock: str,
    scale: float,
    predicted_sync_step_s: float,
    names: tuple[str, ...] = POLICIES,
    on_done: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run each policy in ``names`` on its own fresh loop (real) or virtual loop; their metrics by name."""
    if clock not in ("real", "virtual"):
        raise ValueError(f"clock must be 'real' or 'virtual', got {clock!r}")
    timeout_s = _TIMEOUT_FACTOR * predicted_sync_step_s + 60.0
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        gc.collect()
        if clock == "virtual":
            from verl_async_rm.testing.batcher import run_virtual

            metrics = run_virtual(_one(name, workload, cost, 1.0, replicas, policies, timeout_s))
        else:
            metrics = asyncio.run(_one(name, workload, cost, scale, replicas, policies, timeout_s))
        logger.info("policy %s: step %.3f s, tail %.3f s", name, metrics["step_s"], metrics["reward_tail_s"])
        results[name] = metrics
        if on_done is not None:
            on_done(name, metrics)
    return results
