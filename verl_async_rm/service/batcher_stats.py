"""The batcher's statistics: counters and samples since start (:meth:`Batcher.stats`) and per step
(:class:`StepStats`, :meth:`Batcher.pop_step_stats`), each request counted once as completed, failed, timed out or
cancelled."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from verl_async_rm.percentiles import Samples, Summary
from verl_async_rm.step_counter import StepCounter

__all__ = ["BatcherStats", "StepStats", "FLUSH_REASONS"]

#: Why a batch left: request count, token budget, the oldest request's age, or a flush (explicit, or the step's
#: announced count of requests arrived).
FLUSH_REASONS = ("size", "tokens", "age", "flush")
_STEP_COUNTS = ("submitted", "completed", "failed", "timed_out", "cancelled", "rejected", "batches", "requeued")


@dataclass(frozen=True)
class StepStats:
    """One step's stats (:meth:`Batcher.pop_step_stats`): counters as differences; ``rm_utilization``: batch
    time / (replicas x elapsed); ``tail_s``: from the step's last submit to its last result."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    timed_out: int = 0
    cancelled: int = 0
    rejected: int = 0
    batches: int = 0
    requeued: int = 0
    wait_ms: Summary = Summary()
    exec_ms: Summary = Summary()
    elapsed_s: float = 0.0
    tail_s: float | None = None
    mean_batch_size: float | None = None
    mean_fill: float | None = None
    rm_utilization: float | None = None
    usable_replicas: int = 0  #: all but the lost ones
    replaced_replicas_total: int = 0


class BatcherStats:
    """Counters (:attr:`counts`, each request counted once as completed, failed, timed out or cancelled) and
    samples."""

    def __init__(self, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.counts = StepCounter(_STEP_COUNTS)
        self.batched_requests = self.loop_restarts = 0
        self.real_tokens = self.padded_tokens = 0
        self.flush_reasons = Counter(dict.fromkeys(FLUSH_REASONS, 0))
        self.batch_size, self.wait_s, self.exec_s = Samples(), Samples(), Samples()
        self.step_t0 = self.last_submit = self.last_result = None

    def record_batch(self, size: int, lengths: list[int] | None, reason: str) -> None:
        self.counts.batches += 1
        self.batched_requests += size
        self.flush_reasons[reason] += 1
        self.batch_size.add(size)
        if lengths:
            real = sum(lengths)
            self.real_tokens += real
            self.padded_tokens += max(lengths) * size - real

    def pop_step(self, replicas: int, now: float | None, usable: int, replaced: int) -> StepStats:
        elapsed_s = 0.0 if now is None or self.step_t0 is None else now - self.step_t0
        if now is not None:
            self.step_t0 = now
        mean_size = self.batch_size.pop_step(1.0).mean
        busy = self.exec_s.pop_step()
        submit, result, self.last_submit, self.last_result = self.last_submit, self.last_result, None, None
        return StepStats(
            **{name: int(n) for name, n in self.counts.pop_step().items()}, wait_ms=self.wait_s.pop_step(),
            exec_ms=busy, elapsed_s=elapsed_s,
            tail_s=result - submit if submit is not None and result is not None and result >= submit else None,
            mean_batch_size=mean_size, mean_fill=None if mean_size is None else mean_size / self.max_batch_size,
            rm_utilization=busy.total / 1000.0 / (replicas * elapsed_s) if elapsed_s > 0 else None,
            usable_replicas=usable, replaced_replicas_total=replaced)

    def snapshot(self, live: dict[str, Any]) -> dict[str, Any]:
        counts = self.counts.totals()
        batches = counts["batches"]
        mean_size = self.batched_requests / batches if batches else None
        padded = self.real_tokens + self.padded_tokens
        return {
            **{name: int(counts[name]) for name in _STEP_COUNTS if name not in ("batches", "requeued")}, **live,
            "batches": int(batches), "batch_size": dataclasses.asdict(self.batch_size.summary(1.0)),
            "mean_fill": None if mean_size is None else mean_size / self.max_batch_size,
            "padding_fraction": self.padded_tokens / padded if padded else None,
            "wait_ms": dataclasses.asdict(self.wait_s.summary()), "exec_ms": dataclasses.asdict(self.exec_s.summary()),
            "flush_reasons": dict(self.flush_reasons), "loop_restarts": self.loop_restarts,
            "requeued": int(counts["requeued"])}
