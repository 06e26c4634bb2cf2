"""Counters and recent-sample percentiles kept by the executor: a per-step :class:`StepStats`, and a plain-dict
``snapshot()`` for reports."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

__all__ = ["Samples", "Summary", "StepStats", "ExecutorStats", "FLUSH_REASONS"]

#: Why a batch was flushed: the request count or token budget was reached, the oldest request waited max_wait_ms, or
#: a drain (explicit, or because the expected number of requests of the step arrived) covered the oldest request.
FLUSH_REASONS = ("size", "tokens", "age", "drain", "expect")
#: Counters reported per step, as differences.
_STEP_COUNTS = ("submitted", "completed", "failed", "timed_out", "cancelled", "rejected", "batches", "batched_requests",
                "requeued")


@dataclass(frozen=True)
class Summary:
    """``count``, ``mean`` and ``total`` of the values; nearest-rank percentiles and ``max`` (None without values)."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None
    total: float = 0.0


@dataclass(frozen=True)
class StepStats:
    """What the executor did in one step (:meth:`PendingRequestExecutor.pop_step_stats`).

    Counters are differences over the step. ``rm_utilization`` is the time batches ran over ``slots * elapsed_s``;
    ``tail_s`` runs from the step's last submit to the last result (or error) handed back, None while it is open.
    """

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    timed_out: int = 0
    cancelled: int = 0
    rejected: int = 0
    batches: int = 0
    batched_requests: int = 0
    requeued: int = 0
    wait_ms: Summary = Summary()
    exec_ms: Summary = Summary()
    elapsed_s: float = 0.0
    tail_s: float | None = None
    mean_batch_size: float | None = None
    mean_fill: float | None = None
    rm_utilization: float | None = None
    #: Slots (RM replicas) that can take a batch now or soon (all but the lost ones), and those replaced so far.
    usable_slots: int = 0
    replaced_slots_total: int = 0


class Samples:
    """The most recent ``window`` values of one measurement, summarised on demand.

    Values since the last :meth:`pop_step` are also kept whole, so a step (one rollout) can be summarised exactly.
    """

    __slots__ = ("_values", "_step", "count", "total")

    def __init__(self, window: int = 10_000) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self._step: list[float] = []
        self.count = 0  # all values ever added, not only the window
        self.total = 0.0

    def add(self, value: float) -> None:
        self._values.append(value)
        self._step.append(value)
        self.count += 1
        self.total += value

    def summary(self, scale: float = 1.0) -> Summary:
        """``count`` and ``mean`` over everything added; percentiles and ``max`` over the recent window."""
        return _summarise(self._values, self.count, self.total, scale)

    def pop_step(self, scale: float = 1.0) -> Summary:
        """Summary of the values added since the previous call, which it forgets."""
        step, self._step = self._step, []
        return _summarise(step, len(step), sum(step), scale)


def _summarise(values, count: int, total: float, scale: float) -> Summary:
    if not values:
        return Summary()
    ordered = sorted(values)
    n = len(ordered)

    def pct(q: float) -> float:
        return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))] * scale

    return Summary(count, total / count * scale, pct(0.50), pct(0.90), pct(0.99), ordered[-1] * scale, total * scale)


class ExecutorStats:
    """Everything the executor reports that is not read off the live queue.

    Request outcomes are counted once each: ``completed`` (result delivered), ``failed`` (an exception other than a
    timeout), ``timed_out`` (``RequestTimeoutError``), ``cancelled`` (the caller gave up). ``rejected`` counts submits
    refused at the door (queue full or executor closed); they are not part of ``submitted``.
    """

    def __init__(self, max_batch_size: int, window: int = 10_000) -> None:
        self._max_batch_size = max_batch_size
        self.submitted = self.completed = self.failed = self.cancelled = self.timed_out = self.rejected = 0
        self.batches = self.batched_requests = self.loop_restarts = 0
        self.requeued = 0  # requests put back in the queue because their slot was lost
        self.real_tokens = self.padded_tokens = 0
        self.flush_reasons: Counter[str] = Counter({reason: 0 for reason in FLUSH_REASONS})
        self.batch_size = Samples(window)
        self.wait_s = Samples(window)
        self.exec_s = Samples(window)
        self._step_base = self._counts()
        self.step_t0: float | None = None  # loop time the current step began
        self.step_last_submit: float | None = None  # loop time of the step's latest submit
        self.step_last_settle: float | None = None  # loop time the step's latest request got its result or error

    def record_batch(self, size: int, lengths: list[int] | None, reason: str) -> None:
        """Count one formed batch: its size, why it flushed, and its padding (length padding needs every length)."""
        self.batches += 1
        self.batched_requests += size
        self.flush_reasons[reason] += 1
        self.batch_size.add(size)
        if lengths:
            real = sum(lengths)
            self.real_tokens += real
            self.padded_tokens += max(lengths) * size - real

    def _counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _STEP_COUNTS}

    def pop_step(self, slots: int, now: float | None, usable: int, replaced: int) -> StepStats:
        """What happened since the previous call (one rollout step, ending at loop time ``now``), which it forgets."""
        counts, base = self._counts(), self._step_base
        self._step_base = counts
        elapsed_s = 0.0 if now is None or self.step_t0 is None else now - self.step_t0
        if now is not None:
            self.step_t0 = now
        mean_size = self.batch_size.pop_step().mean
        busy = self.exec_s.pop_step(scale=1000.0)
        last_submit, last_settle = self.step_last_submit, self.step_last_settle
        self.step_last_submit = self.step_last_settle = None
        return StepStats(
            **{name: counts[name] - base[name] for name in _STEP_COUNTS},
            wait_ms=self.wait_s.pop_step(scale=1000.0),
            exec_ms=busy,
            elapsed_s=elapsed_s,
            tail_s=(last_settle - last_submit) if last_submit is not None and last_settle is not None
            and last_settle >= last_submit else None,
            mean_batch_size=mean_size,
            mean_fill=None if mean_size is None else mean_size / self._max_batch_size,
            rm_utilization=(busy.total / 1000.0 / (slots * elapsed_s)) if elapsed_s > 0 else None,
            usable_slots=usable,
            replaced_slots_total=replaced,
        )

    def snapshot(self, live: dict[str, Any]) -> dict[str, Any]:
        """A JSON-serialisable dict: the counters, the summaries, and ``live`` (queue state read by the caller)."""
        mean_size = self.batched_requests / self.batches if self.batches else None
        padded_total = self.real_tokens + self.padded_tokens
        return {
            "submitted": self.submitted,
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "timed_out": self.timed_out,
            "rejected": self.rejected,
            **live,
            "batches": self.batches,
            "batch_size": dataclasses.asdict(self.batch_size.summary()),
            "mean_fill": None if mean_size is None else mean_size / self._max_batch_size,
            "padding_fraction": self.padded_tokens / padded_total if padded_total else None,
            "wait_ms": dataclasses.asdict(self.wait_s.summary(scale=1000.0)),
            "exec_ms": dataclasses.asdict(self.exec_s.summary(scale=1000.0)),
            "flush_reasons": dict(self.flush_reasons),
            "loop_restarts": self.loop_restarts,
            "requeued": self.requeued,
        }
