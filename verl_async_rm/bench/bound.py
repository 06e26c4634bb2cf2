"""What the best scheduler could do on a workload, and what the model predicts for ``sync`` (no clock involved).

``bound_s``, a lower bound on the step time of any scheduler that sends batches of at most ``max_batch_size`` items to
``R`` replicas costing ``a + b * padded_tokens`` per batch, is the larger of:

* ``last finish + lone latency``: the last trajectory cannot be scored before it exists, and scoring it takes at least
  ``a + b * its tokens`` (alone, with no padding);
* ``total work / R``: every batch costs at least ``a`` plus ``b`` per real token, and there are at least
  ``ceil(B / max_batch_size)`` batches, so ``(b * sum(tokens) + a * ceil(B / cap)) / R`` of RM time must pass on
  ``R`` replicas that start no earlier than time 0.

``sync`` is modelled as the best a score-after-rollout scheduler can do: at the last finish, sort every trajectory by
length (longest first, so batches waste little padding), cut cap-sized batches, and hand each batch in that order to
the replica that frees first. :func:`sync_batches` gives those batches (the benchmark's ``sync`` policy runs exactly
them) and :func:`sync_rm_s` the time they take by the model.

The predicted speedup of overlapping the RM with the rollout is ``(rollout + RM) / (rollout + tail)`` with
``rollout`` the last finish, ``RM`` the modelled ``sync`` scoring time and ``tail`` the lone latency of the last
trajectory (the best possible tail).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from verl_async_rm.bench.workload import RMCostModel, Workload

__all__ = ["Bound", "compute_bound", "sync_batches", "sync_rm_s"]


@dataclass(frozen=True)
class Bound:
    """The computed figures of one workload (all in workload seconds)."""

    bound_s: float  #: max(last_finish_bound_s, work_bound_s)
    rollout_s: float  #: the last finish
    lone_latency_s: float  #: a + b * tokens of the last trajectory to finish
    last_finish_bound_s: float  #: rollout_s + lone_latency_s
    total_work_s: float  #: b * sum(tokens) + a * ceil(B / cap), the least RM time all batches together take
    work_bound_s: float  #: total_work_s / replicas
    sync_rm_s: float  #: modelled scoring time of `sync` after the rollout
    predicted_sync_step_s: float  #: rollout_s + sync_rm_s
    predicted_speedup: float  #: (rollout_s + sync_rm_s) / (rollout_s + lone_latency_s)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def sync_batches(tokens: Sequence[int], max_batch_size: int) -> list[list[int]]:
    """Indices of ``tokens`` sorted longest first (ties: lower index first), cut into batches of ``max_batch_size``."""
    _check_cap(max_batch_size)
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    return [order[k:k + max_batch_size] for k in range(0, len(order), max_batch_size)]


def sync_rm_s(tokens: Sequence[int], cost: RMCostModel, replicas: int, max_batch_size: int) -> float:
    """Makespan of :func:`sync_batches` on ``replicas`` replicas that all start free, each batch to the first free."""
    _check_replicas(replicas)
    free_at = [0.0] * replicas
    for batch in sync_batches(tokens, max_batch_size):
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + cost.batch_s([tokens[i] for i in batch]))
    return max(free_at)


def compute_bound(workload: Workload, cost: RMCostModel, replicas: int, max_batch_size: int) -> Bound:
    """The lower bound and the ``sync`` prediction for ``workload`` (see the module docstring)."""
    _check_replicas(replicas)
    _check_cap(max_batch_size)
    tokens = workload.tokens
    rollout = workload.rollout_s
    lone = cost.lone_s(tokens[workload.last])
    total_work = cost.b_s_per_token * sum(tokens) + cost.a_s * math.ceil(len(tokens) / max_batch_size)
    sync_rm = sync_rm_s(tokens, cost, replicas, max_batch_size)
    return Bound(
        bound_s=max(rollout + lone, total_work / replicas),
        rollout_s=rollout,
        lone_latency_s=lone,
        last_finish_bound_s=rollout + lone,
        total_work_s=total_work,
        work_bound_s=total_work / replicas,
        sync_rm_s=sync_rm,
        predicted_sync_step_s=rollout + sync_rm,
        predicted_speedup=(rollout + sync_rm) / (rollout + lone),
    )


def _check_replicas(replicas: int) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}; give the number of RM replicas")


def _check_cap(max_batch_size: int) -> None:
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
