"""The per-step ``async_rm/*`` metrics, from the executor's step figures (``pop_step_stats``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["step_metrics", "PREFIX", "VAL_PREFIX"]

PREFIX = "async_rm/"
#: Validation passes on the v1 trainer (verl names its own validation metrics ``val-core/``, ``val-aux/``).
VAL_PREFIX = "val-async_rm/"


def step_metrics(
    executor_step: Mapping[str, Any],
    replica_steps: Sequence[Mapping[str, Any]] = (),
    trajectories: Any = None,
    prefix: str = PREFIX,
) -> dict[str, float]:
    """Flat ``{"async_rm/<name>": number}`` for one step; figures with no value this step (no batch ran) are left out.

    ``replica_steps`` are the RM replicas' own step counters (``RewardModelWorker.pop_step_stats``): inputs
    truncated to ``max_length`` and items the RM failed (bad input, NaN score...). ``trajectories`` (a
    :class:`~verl_async_rm.integration.ledger.PhaseRecord`, v1) gives ``requests``/``scored``/``errors`` as the
    agent-loop workers counted them for one phase, instead of the executor's counts over every phase.

    ``reward_tail_s`` is the time from the step's last trajectory reaching the executor (right after its agent loop
    ended) to the last score handed back, measured on the executor's one clock.
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
        "truncated": sum(r.get("truncated", 0) for r in replica_steps) if replica_steps else None,
        "rm_failed_items": sum(r.get("failed", 0) for r in replica_steps) if replica_steps else None,
    }
    if trajectories is not None:
        values.update(requests=trajectories.requests, scored=trajectories.scored, errors=trajectories.failed)
    return {prefix + name: float(value) for name, value in values.items() if value is not None}


def _usable(executor_step: Mapping[str, Any]) -> int | None:
    """Replicas that can take a batch now or soon (all but the lost ones)."""
    states = [executor_step.get(f"slots_{state}") for state in ("free", "busy", "late", "replacing")]
    return None if any(v is None for v in states) else sum(states)
