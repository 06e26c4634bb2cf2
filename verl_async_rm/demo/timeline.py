"""What one demo step recorded (trajectory finish times, RM batches per replica) and the figures computed from it.

Pure code (no Ray, no torch): the demo's modes fill :class:`StepTimeline` from the trajectories' finish times (recorded
by the demo's agent loop), the RM replicas' batch records and verl's served-RM request records, all ``time.time()`` on
one machine; the table, the JSON summary and the plot read the figures from here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MODE_KEYS", "STEP_KEYS", "BatchRecord", "StepTimeline", "mode_summary", "speedup"]

#: Keys of every step's figures (``StepTimeline.metrics()``), in every mode.
STEP_KEYS = (
    "step_time_s",
    "rollout_s",
    "reward_tail_s",
    "rm_utilization",
    "rm_busy_s",
    "rm_busy_per_trajectory_ms",
    "batches",
    "mean_batch_size",
    "trajectories",
    "scored",
    "reward_mean",
    "rm_score_mean",
    "rule_score_mean",
)
#: Keys of a mode's summary over its steps (means, except ``batches``: the total).
MODE_KEYS = ("steps", "step_time_s", "reward_tail_s", "rm_utilization", "rm_busy_per_trajectory_ms", "batches",
             "mean_batch_size")


@dataclass(frozen=True)
class BatchRecord:
    """One scoring call on one RM replica: wall-clock ``start``/``end`` (seconds) and how many trajectories."""

    replica: int
    start: float
    end: float
    size: int

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"BatchRecord end ({self.end}) is before start ({self.start})")
        if self.size < 0:
            raise ValueError(f"BatchRecord size must be >= 0, got {self.size}")

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class StepTimeline:
    """One step of one mode, on one wall clock.

    Attributes:
        mode: ``"async"`` (the plugin: score as each trajectory ends), ``"sync"`` (score the batch after the
            rollout) or ``"verl_served"`` (verl's own vLLM-served RM, one request per trajectory as it ends).
        step: step number (1-based).
        t0, t_end: when the step started (prompts handed to the agent loop) and ended (every reward known).
        finishes: when each trajectory's generation ended.
        batches: the RM calls of the step, every replica (the plugin's replicas, async and sync).
        rm_calls: ``(start, end)`` of each RM request of verl's served RM, seen by verl's reward-loop worker (vLLM
            batches them inside its engine, out of sight): ``verl_served`` only.
        num_replicas: RM replicas available during the step.
        rewards, rm_scores, rule_scores: per trajectory, in batch order.
        responses: per trajectory, a digest of its response token ids (the modes' scores compare where equal).
        extra: mode-specific figures kept in the JSON (e.g. the executor's own reward tail).
    """

    mode: str
    step: int
    t0: float
    t_end: float
    finishes: list[float]
    batches: list[BatchRecord]
    num_replicas: int
    rewards: list[float] = field(default_factory=list)
    rm_scores: list[float] = field(default_factory=list)
    rule_scores: list[float] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    rm_calls: list[tuple[float, float]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.t_end < self.t0:
            raise ValueError(f"StepTimeline t_end ({self.t_end}) is before t0 ({self.t0})")
        if self.num_replicas < 1:
            raise ValueError(f"StepTimeline num_replicas must be >= 1, got {self.num_replicas}")

    @property
    def step_time_s(self) -> float:
        return self.t_end - self.t0

    @property
    def last_finish(self) -> float | None:
        return max(self.finishes) if self.finishes else None

    @property
    def last_score(self) -> float | None:
        ends = [b.end for b in self.batches] + [end for _, end in self.rm_calls]
        return max(ends) if ends else None

    @property
    def rm_busy_s(self) -> float:
        """Wall time with at least one RM call in flight (the union of the batches' or requests' intervals)."""
        return _union_length([(b.start, b.end) for b in self.batches] + list(self.rm_calls))

    def metrics(self) -> dict[str, Any]:
        """The step's figures (keys :data:`STEP_KEYS`); None where the step has nothing to measure.

        ``reward_tail_s``: last RM batch end minus last trajectory finish (how long rewards lag the rollout).
        ``rm_utilization``: time the replicas spent scoring / (replicas x step time) (the plugin's replicas only).
        ``rm_busy_s``: wall time with at least one RM call in flight, every mode measured alike
        (:attr:`rm_busy_s`); ``rm_busy_per_trajectory_ms`` divides it by the trajectories.
        """
        last_finish, last_score = self.last_finish, self.last_score
        busy = sum(b.duration for b in self.batches)
        sizes = [b.size for b in self.batches]
        return {
            "step_time_s": self.step_time_s,
            "rollout_s": None if last_finish is None else last_finish - self.t0,
            "reward_tail_s": None if last_finish is None or last_score is None else last_score - last_finish,
            "rm_utilization": (busy / (self.num_replicas * self.step_time_s)
                               if self.step_time_s > 0 and not self.rm_calls else None),
            "rm_busy_s": self.rm_busy_s,
            "rm_busy_per_trajectory_ms": 1e3 * self.rm_busy_s / len(self.finishes) if self.finishes else None,
            "batches": len(self.batches) if not self.rm_calls else None,
            "mean_batch_size": sum(sizes) / len(sizes) if sizes else None,
            "trajectories": len(self.finishes),
            "scored": sum(sizes) + len(self.rm_calls),
            "reward_mean": _mean(self.rewards),
            "rm_score_mean": _mean(self.rm_scores),
            "rule_score_mean": _mean(self.rule_scores),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON form: the figures plus the raw timeline, times in seconds since ``t0``."""
        return {
            "mode": self.mode,
            "step": self.step,
            **self.metrics(),
            **self.extra,
            "timeline": {
                "t0_unix": self.t0,
                "end_s": self.step_time_s,
                "finishes_s": sorted(t - self.t0 for t in self.finishes),
                "batches": [
                    {"replica": b.replica, "start_s": b.start - self.t0, "end_s": b.end - self.t0, "size": b.size}
                    for b in sorted(self.batches, key=lambda b: (b.start, b.replica))
                ],
                "rm_calls": [{"start_s": a - self.t0, "end_s": b - self.t0} for a, b in sorted(self.rm_calls)],
            },
            "rewards": list(self.rewards),
            "rm_scores": list(self.rm_scores),
            "rule_scores": list(self.rule_scores),
            "responses": list(self.responses),
        }


def mode_summary(steps: Sequence[StepTimeline]) -> dict[str, Any]:
    """A mode's figures over its steps (keys :data:`MODE_KEYS`): means per step, ``batches`` summed."""
    rows = [s.metrics() for s in steps]

    def mean_of(key: str) -> float | None:
        return _mean([r[key] for r in rows if r[key] is not None])

    return {
        "steps": len(rows),
        "step_time_s": mean_of("step_time_s"),
        "reward_tail_s": mean_of("reward_tail_s"),
        "rm_utilization": mean_of("rm_utilization"),
        "rm_busy_per_trajectory_ms": mean_of("rm_busy_per_trajectory_ms"),
        "batches": None if any(r["batches"] is None for r in rows) else sum(r["batches"] for r in rows),
        "mean_batch_size": _weighted_batch_size(steps),
    }


def speedup(modes: Mapping[str, Mapping[str, Any]]) -> float | None:
    """Sync mean step time / async mean step time (None when either is missing)."""
    sync, asy = modes.get("sync", {}).get("step_time_s"), modes.get("async", {}).get("step_time_s")
    if not sync or not asy:
        return None
    return sync / asy


def _weighted_batch_size(steps: Sequence[StepTimeline]) -> float | None:
    sizes = [b.size for s in steps for b in s.batches]
    return sum(sizes) / len(sizes) if sizes else None


def _union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _mean(values: Sequence[float]) -> float | None:
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return statistics.fmean(finite) if finite else None
