"""The per-step ``async_rm/*`` metrics: one RM service's step as flat metrics (the batcher's step stats and the
replicas' own counters), then prefixed, with the trajectory counts of the phase, by the manager."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from verl_async_rm.service.batcher_stats import StepStats
from verl_async_rm.service.group_gate import GroupStats

if TYPE_CHECKING:
    from verl_async_rm.scoring.batch import ScorerStats

__all__ = ["service_step_metrics", "judge_cost", "group_metrics", "step_metrics", "PREFIX", "VAL_PREFIX"]

PREFIX = "async_rm/"
#: Validation passes on the v1 trainer (verl names its own validation metrics ``val-core/``, ``val-aux/``).
VAL_PREFIX = "val-async_rm/"


def service_step_metrics(step: StepStats, replica_steps: Sequence[ScorerStats] = (), group: GroupStats | None = None,
                         reasks: int = 0) -> dict[str, float]:
    """Flat ``{name: number}`` of one step, with the replicas' counters (``RMReplica.pop_step_stats``, or an
    endpoint's slots'); metrics with no value are left out. ``reward_tail_s``: from the step's last request to its last
    score, on the service. A group judge's ``group`` (its gate's stats) gives the trajectory counts and tail, the
    batcher's being its judge calls; ``reasks`` (a judge's replies asked again) are batcher requests that are not
    trajectories."""
    values: dict[str, float | int | None] = {
        "requests": step.submitted - reasks, "scored": step.completed, "errors": step.failed + step.timed_out - reasks,
        "batches": step.batches, "mean_batch_size": step.mean_batch_size, "mean_fill": step.mean_fill,
        "queue_wait_ms/mean": step.wait_ms.mean, "queue_wait_ms/p99": step.wait_ms.p99,
        "rm_exec_ms/mean": step.exec_ms.mean, "rm_exec_ms/p99": step.exec_ms.p99, "rm_utilization": step.rm_utilization,
        "reward_tail_s": step.tail_s, "requeued": step.requeued, "replicas_usable": step.usable_replicas,
        "replicas_replaced_total": step.replaced_replicas_total}
    if group is not None:
        values.update(group_metrics(group))
    if replica_steps:
        values["truncated"] = sum(r.truncated for r in replica_steps)
        values["rm_failed_items"] = sum(r.failed for r in replica_steps)
        dropped = [r.steps_dropped for r in replica_steps if r.steps_dropped is not None]
        if dropped:
            values["steps_dropped"] = sum(dropped)
        judged = [r for r in replica_steps if r.judge_tokens is not None]  # judges that write their verdict
        if judged:
            values["judge_parse_failures"] = sum(r.judge_parse_failures or 0 for r in judged)
            values["judge_cut_replies"] = sum(r.judge_cut_replies or 0 for r in judged)
            values["judge_reasks"] = reasks
            values.update(judge_cost(int(values["requests"] or 0), sum(r.requests for r in judged),
                                     sum(r.tokens for r in judged), sum(r.judge_tokens or 0 for r in judged)))
    return {name: float(value) for name, value in values.items() if value is not None}


def judge_cost(trajectories: int, calls: int, tokens_in: int, tokens_out: int) -> dict[str, float]:
    """A judge that writes, this step: its calls (re-asks included), the tokens it read and wrote, and those per
    trajectory (``trajectories``: the step's trajectories the RM answered)."""
    values = {"judge_calls": float(calls), "judge_tokens_in": float(tokens_in), "judge_tokens": float(tokens_out)}
    if trajectories > 0:
        values["judge_tokens_in_per_trajectory"] = tokens_in / trajectories
        values["judge_tokens_out_per_trajectory"] = tokens_out / trajectories
    return values


def group_metrics(group: GroupStats) -> dict[str, float | None]:
    """A group judge's gate this step: its trajectories (in, scored, failed) and their tail, the groups judged and
    those judged partial, and the wait from a group's first member to its judging (p50, p99, seconds)."""
    wait = group.wait_s.summary(1.0)
    return {"requests": group.requests, "scored": group.scored, "errors": group.errors, "reward_tail_s": group.tail_s,
            "groups_judged": group.groups, "groups_partial": group.partial, "group_wait_s/p50": wait.p50,
            "group_wait_s/p99": wait.p99}


def step_metrics(service_step: Mapping[str, float], trajectories: Any = None, prefix: str = PREFIX) -> dict[str, float]:
    """``{prefix + name: number}`` from :meth:`RMService.end_step`'s metrics; ``trajectories`` (a ``PhaseRecord``,
    v1) gives ``requests``/``scored``/``errors`` as the agent-loop workers counted them for one phase instead."""
    values = dict(service_step)
    if trajectories is not None:
        values.update(requests=trajectories.requests, scored=trajectories.scored, errors=trajectories.failed)
    return {prefix + name: float(value) for name, value in values.items()}
