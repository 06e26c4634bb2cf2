"""The simulated RM replicas of the overlap benchmark, the clock they run on, and the figures read from their records.

:class:`SimulatedRM` is an ``async batch_fn(items, replica, deadline)``: it sleeps ``RMCostModel.batch_s`` (scaled to
the clock) and returns each item's index, so a caller that gets another trajectory's answer is caught. It refuses to
run two batches at once on one replica (a replica is one GPU), records every batch, and stamps each item's batch
start.

All times are "workload seconds": :class:`Clock` divides the event loop's time since the start by ``scale`` (real
seconds per workload second; 1 on the virtual clock).
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from verl_async_rm.bench.workload import RMCostModel

__all__ = ["BatchRecord", "Clock", "Item", "SimulatedRM", "policy_metrics"]


class Clock:
    """Workload time on the running event loop: ``(loop.time() - t0) / scale``."""

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"time scale must be > 0 real seconds per workload second, got {scale!r}")
        self.scale = scale
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()

    def now(self) -> float:
        return (self._loop.time() - self._t0) / self.scale

    async def sleep(self, workload_s: float) -> None:
        await asyncio.sleep(workload_s * self.scale)

    async def sleep_until(self, workload_t: float) -> None:
        await asyncio.sleep(max(0.0, self._t0 + workload_t * self.scale - self._loop.time()))


@dataclass
class Item:
    """One trajectory as the RM sees it."""

    index: int
    tokens: int
    ready_s: float | None = None  # when it was handed to the scheduler
    start_s: float | None = None  # when its batch started on a replica
    scored_s: float | None = None  # when its caller had the score
    batch_size: int | None = None  # size of the batch it ran in
    batch_model_s: float | None = None  # what that batch should take by the cost model
    group: int | None = None  # its prompt, shared with its siblings (GRPO); None: no siblings


@dataclass(frozen=True)
class BatchRecord:
    replica: Any
    start_s: float
    end_s: float
    size: int
    real_tokens: int
    padded_tokens: int
    with_sibling: int = 0  # items of the batch that met at least one sibling in it


@dataclass
class SimulatedRM:
    """``async (items, replica, deadline) -> [item.index, ...]`` sleeping ``cost.batch_s`` workload seconds per call."""

    cost: RMCostModel
    clock: Clock
    batches: list[BatchRecord] = field(default_factory=list)
    _busy: set = field(default_factory=set)

    async def __call__(self, items: list[Item], replica: Any, deadline: float) -> list[int]:
        if replica in self._busy:
            raise RuntimeError(f"simulated RM replica {replica!r} got a second batch while one is running")
        self._busy.add(replica)
        try:
            lengths = [item.tokens for item in items]
            start = self.clock.now()
            model_s = self.cost.batch_s(lengths)
            for item in items:
                item.start_s, item.batch_size, item.batch_model_s = start, len(items), model_s
            await self.clock.sleep(model_s)
            groups = Counter(item.group for item in items if item.group is not None)
            self.batches.append(BatchRecord(replica, start, self.clock.now(), len(items), sum(lengths),
                                            self.cost.padded_tokens(lengths),
                                            sum(n for n in groups.values() if n > 1)))
            return [item.index for item in items]
        finally:
            self._busy.discard(replica)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def policy_metrics(items: list[Item], batches: list[BatchRecord], replicas: int) -> dict[str, Any]:
    """The per-policy figures of the report, from what one run recorded (workload seconds unless named ``_ms``).

    ``step_s``: last score (time 0 = rollout start). ``reward_tail_s``: last score minus last finish (as observed).
    ``rm_utilization``: replica busy time over ``replicas x`` (last score - first finish), the span in which there was
    RM work to do. ``padding_fraction``: padded-away tokens over all tokens the batches cost. ``*_wait_ms``: from a
    trajectory's finish to the start of its batch. ``last_item_*`` split the tail of the trajectory that finished
    last: its wait for a batch (scheduling), its batch's size and modelled time, and how much longer than the model
    it took from batch start to its caller holding the score (timer lateness and CPU contention on the real clock).
    ``siblings_met``: the share of trajectories scored in a batch holding at least one of their siblings (whose
    common prompt the RM computes once with ``share_prompts``); None when trajectories have no siblings.
    """
    missing = [item.index for item in items if item.scored_s is None or item.start_s is None]
    if missing:
        raise RuntimeError(f"{len(missing)} trajectories were never scored (first: {missing[:5]})")
    step = max(item.scored_s for item in items)  # type: ignore[type-var]
    first_ready = min(item.ready_s for item in items)  # type: ignore[type-var]
    last_ready = max(item.ready_s for item in items)  # type: ignore[type-var]
    busy = sum(b.end_s - b.start_s for b in batches)
    padded = sum(b.padded_tokens for b in batches)
    waits_ms = [(item.start_s - item.ready_s) * 1e3 for item in items]  # type: ignore[operator]
    span = step - first_ready
    last = max(items, key=lambda item: (item.ready_s, -item.index))
    return {
        "step_s": step,
        "reward_tail_s": step - last_ready,
        "rm_utilization": busy / (replicas * span) if span > 0 else None,
        "mean_batch_size": sum(b.size for b in batches) / len(batches),
        "padding_fraction": (padded - sum(b.real_tokens for b in batches)) / padded if padded else 0.0,
        "siblings_met": (sum(b.with_sibling for b in batches) / len(items)
                         if any(item.group is not None for item in items) else None),
        "p50_wait_ms": statistics.median(waits_ms),
        "p99_wait_ms": _quantile(waits_ms, 0.99),
        "batches": len(batches),
        "rm_busy_s": busy,
        "last_finish_s": last_ready,
        "scored": len(items),
        "last_item_wait_ms": (last.start_s - last.ready_s) * 1e3,  # type: ignore[operator]
        "last_item_batch_size": last.batch_size,
        "last_item_batch_model_ms": last.batch_model_s * 1e3,  # type: ignore[operator]
        "last_item_late_ms": (last.scored_s - last.start_s - last.batch_model_s) * 1e3,  # type: ignore[operator]
    }
