"""The per-step ``async_rm/*`` metrics: one RM service's step in flat figures (the batcher's step figures and the
replicas' own counters), then prefixed, with the trajectory counts of the phase, by the manager."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from verl_async_rm.service.batcher_stats import StepStats

if TYPE_CHECKING:
    from verl_async_rm.scoring.scorer import ScorerStats

__all__ = ["service_step_metrics", "step_metrics", "PREFIX", "VAL_PREFIX"]

PREFIX = "async_rm/"
#: Validation passes on the v1 trainer (verl names its own validation metrics ``val-core/``, ``val-aux/``).
VAL_PREFIX = "val-async_rm/"


def service_step_metrics(step: StepStats, replica_steps: Sequence[ScorerStats] = ()) -> dict[str, float]:
    """Flat ``{name: number}`` of one step, with the replicas' counters (``RMReplica.pop_step_stats``); figures
    with no value are left out. ``reward_tail_s``: from the step's last request to its last score, on the service."""
    values = {
        "requests": step.submitted, "scored": step.completed, "errors": step.failed + step.timed_out,
        "batches": step.batches, "mean_batch_size": step.mean_batch_size, "mean_fill": step.mean_fill,
        "queue_wait_ms/mean": step.wait_ms.mean, "queue_wait_ms/p99": step.wait_ms.p99,
        "rm_exec_ms/mean": step.exec_ms.mean, "rm_exec_ms/p99": step.exec_ms.p99, "rm_utilization": step.rm_utilization,
        "reward_tail_s": step.tail_s, "requeued": step.requeued, "replicas_usable": step.usable_replicas,
        "replicas_replaced_total": step.replaced_replicas_total}
    if replica_steps:
        values["truncated"] = sum(r.truncated for r in replica_steps)
        values["rm_failed_items"] = sum(r.failed for r in replica_steps)
        dropped = [r.steps_dropped for r in replica_steps if r.steps_dropped is not None]
        if dropped:
            values["steps_dropped"] = sum(dropped)
        judged = [r for r in replica_steps if r.judge_tokens is not None]  # judges that write their verdict
        if judged:
            values["judge_tokens"] = sum(r.judge_tokens for r in judged)
            values["judge_parse_failures"] = sum(r.judge_parse_failures or 0 for r in judged)
    return {name: float(value) for name, value in values.items() if value is not None}


def step_metrics(service_step: Mapping[str, float], trajectories: Any = None, prefix: str = PREFIX) -> dict[str, float]:
    """``{prefix + name: number}`` from :meth:`RMService.end_step`'s figures; ``trajectories`` (a ``PhaseRecord``,
    v1) gives ``requests``/``scored``/``errors`` as the agent-loop workers counted them for one phase instead."""
    values = dict(service_step)
    if trajectories is not None:
        values.update(requests=trajectories.requests, scored=trajectories.scored, errors=trajectories.failed)
    return {prefix + name: float(value) for name, value in values.items()}
