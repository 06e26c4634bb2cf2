"""One step of an RM service in flat figures: the batcher's step figures and the replicas' own counters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl_async_rm.scoring.scorer import ScorerStats

__all__ = ["service_step_metrics"]


def service_step_metrics(
    executor_step: Mapping[str, Any], replica_steps: Sequence[ScorerStats] = ()
) -> dict[str, float]:
    """Flat ``{name: number}`` for one step; figures with no value this step (no batch ran) are left out.

    ``executor_step`` is ``PendingRequestExecutor.pop_step_stats()``; ``replica_steps`` are the replicas' step
    counters (``RMReplica.pop_step_stats``): inputs truncated to ``max_length`` and items the RM failed (bad
    input, NaN score...). ``reward_tail_s`` runs from the step's last request reaching the service (right after its
    agent loop ended) to the last score handed back, on the service's one clock.
    """
    wait, exe = executor_step.get("wait_ms") or {}, executor_step.get("exec_ms") or {}
    values = {
        "requests": executor_step.get("submitted"),
        "scored": executor_step.get("completed"),
        "errors": (executor_step.get("failed") or 0) + (executor_step.get("timed_out") or 0),
        "batches": executor_step.get("batches"),
        "mean_batch_size": executor_step.get("mean_batch_size"),
        "mean_fill": executor_step.get("mean_fill"),
        "queue_wait_ms/mean": wait.get("mean"),
        "queue_wait_ms/p99": wait.get("p99"),
        "rm_exec_ms/mean": exe.get("mean"),
        "rm_exec_ms/p99": exe.get("p99"),
        "rm_utilization": executor_step.get("rm_utilization"),
        "reward_tail_s": executor_step.get("tail_s"),
        "requeued": executor_step.get("requeued"),
        "replicas_usable": _usable(executor_step),
        "replicas_replaced_total": executor_step.get("slots_replaced_total"),
        "truncated": sum(r.truncated for r in replica_steps) if replica_steps else None,
        "rm_failed_items": sum(r.failed for r in replica_steps) if replica_steps else None,
        # process RMs only: leading steps left unscored because the input exceeded max_length
        "steps_dropped": sum(r.steps_dropped for r in replica_steps if r.steps_dropped is not None)
        if any(r.steps_dropped is not None for r in replica_steps) else None,
    }
    return {name: float(value) for name, value in values.items() if value is not None}


def _usable(executor_step: Mapping[str, Any]) -> int | None:
    """Replicas that can take a batch now or soon (all but the lost ones)."""
    states = [executor_step.get(f"slots_{state}") for state in ("free", "busy", "late", "replacing")]
    return None if any(v is None for v in states) else sum(states)
