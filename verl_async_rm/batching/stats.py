"""Counters and recent-sample percentiles kept by the executor; ``snapshot()`` turns them into a plain dict."""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Any

__all__ = ["Samples", "ExecutorStats", "FLUSH_REASONS"]

#: Why a batch was flushed: the request count or token budget was reached, the oldest request waited max_wait_ms, or
#: a drain (explicit, or because the expected number of requests of the step arrived) covered the oldest request.
FLUSH_REASONS = ("size", "tokens", "age", "drain", "expect")
#: Counters reported per step by :meth:`ExecutorStats.pop_step`, as differences.
_STEP_COUNTS = ("submitted", "completed", "failed", "timed_out", "cancelled", "rejected", "batches", "batched_requests",
                "requeued")


class Samples:
    """The most recent ``window`` values of one measurement, summarised on demand (nearest-rank percentiles).

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

    def summary(self, scale: float = 1.0) -> dict[str, float | int | None]:
        """``count`` and ``mean`` over everything added; percentiles and ``max`` over the recent window."""
        return _summarise(self._values, self.count, self.total, scale)

    def pop_step(self, scale: float = 1.0) -> dict[str, float | int | None]:
        """Summary (``total`` included) of the values added since the previous call, which it forgets."""
        step, self._step = self._step, []
        out = _summarise(step, len(step), sum(step), scale)
        out["total"] = sum(step) * scale
        return out


def _summarise(values, count: int, total: float, scale: float) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)
    n = len(ordered)

    def pct(q: float) -> float:
        return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))] * scale

    return {
        "count": count,
        "mean": total / count * scale,
        "p50": pct(0.50),
        "p90": pct(0.90),
        "p99": pct(0.99),
        "max": ordered[-1] * scale,
    }


class ExecutorStats:
    """Everything ``PendingRequestExecutor.stats()`` reports that is not read off the live queue.

    Request outcomes are counted once each: ``completed`` (result delivered), ``failed`` (an exception other than a
    timeout), ``timed_out`` (``RequestTimeoutError``), ``cancelled`` (the caller gave up). ``rejected`` counts submits
    refused at the door (queue full or executor closed); they are not part of ``submitted``.
    """

    def __init__(self, max_batch_size: int, window: int = 10_000) -> None:
        self._max_batch_size = max_batch_size
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.timed_out = 0
        self.rejected = 0
        self.batches = 0
        self.batched_requests = 0
        self.loop_restarts = 0
        self.requeued = 0  # requests put back in the queue because their slot was lost
        self.real_tokens = 0
        self.padded_tokens = 0
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
            longest = max(lengths)
            real = sum(lengths)
            self.real_tokens += real
            self.padded_tokens += longest * size - real

    def _counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _STEP_COUNTS}

    def pop_step(self, slots: int, now: float | None) -> dict[str, Any]:
        """What happened since the previous call (one rollout step, ending at loop time ``now``), which it forgets.

        ``rm_utilization`` is the time batches ran divided by ``slots * elapsed_s``; ``tail_s`` is the time from the
        step's last submit to the last result (or error) handed back, None if the last request is still open.
        """
        counts, base = self._counts(), self._step_base
        self._step_base = counts
        elapsed_s = 0.0 if now is None or self.step_t0 is None else now - self.step_t0
        if now is not None:
            self.step_t0 = now
        out: dict[str, Any] = {name: counts[name] - base[name] for name in _STEP_COUNTS}
        sizes = self.batch_size.pop_step()
        busy = self.exec_s.pop_step()
        last_submit, last_settle = self.step_last_submit, self.step_last_settle
        self.step_last_submit = self.step_last_settle = None
        out.update(
            tail_s=(last_settle - last_submit) if last_submit is not None and last_settle is not None
            and last_settle >= last_submit else None,
            mean_batch_size=sizes["mean"],
            mean_fill=None if sizes["mean"] is None else sizes["mean"] / self._max_batch_size,
            wait_ms=self.wait_s.pop_step(scale=1000.0),
            exec_ms={k: (None if v is None else v * 1000.0) for k, v in busy.items() if k != "count"},
            rm_utilization=(busy["total"] / (slots * elapsed_s)) if elapsed_s > 0 else None,
            elapsed_s=elapsed_s,
        )
        return out

    def snapshot(self, live: dict[str, Any]) -> dict[str, Any]:
        """A JSON-serialisable dict: the counters, the summaries, and ``live`` (queue state read by the caller)."""
        mean_size = self.batched_requests / self.batches if self.batches else None
        padded_total = self.real_tokens + self.padded_tokens
        out: dict[str, Any] = {
            "submitted": self.submitted,
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "timed_out": self.timed_out,
            "rejected": self.rejected,
        }
        out.update(live)
        out.update(
            {
                "batches": self.batches,
                "batch_size": self.batch_size.summary(),
                "mean_fill": None if mean_size is None else mean_size / self._max_batch_size,
                "padding_fraction": self.padded_tokens / padded_total if padded_total else None,
                "wait_ms": self.wait_s.summary(scale=1000.0),
                "exec_ms": self.exec_s.summary(scale=1000.0),
                "flush_reasons": dict(self.flush_reasons),
                "loop_restarts": self.loop_restarts,
                "requeued": self.requeued,
            }
        )
        return out
