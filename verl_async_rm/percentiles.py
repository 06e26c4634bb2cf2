"""Samples of a timing or a size and their :class:`Summary`: the last values (percentiles), the all-time count and
total, and the values of the current step (the batcher's and the remote client's statistics)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Samples", "Summary"]


@dataclass(frozen=True)
class Summary:
    """``count``, ``mean``, ``total``; nearest-rank percentiles and ``max`` (None without values)."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None
    total: float = 0.0


class Samples:
    """The last ``window`` values (percentiles), all-time count and total, and the values of the current step."""

    __slots__ = ("_values", "_step", "count", "total")

    def __init__(self, window: int = 10_000) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self._step: list[float] = []
        self.count, self.total = 0, 0.0

    def add(self, value: float) -> None:
        self._values.append(value)
        self._step.append(value)
        self.count += 1
        self.total += value

    def summary(self, scale: float = 1000.0) -> Summary:
        return _summarise(self._values, self.count, self.total, scale)

    def pop_step(self, scale: float = 1000.0) -> Summary:
        step, self._step = self._step, []
        return _summarise(step, len(step), sum(step), scale)


def _summarise(values: Iterable[float], count: int, total: float, scale: float) -> Summary:
    ordered = sorted(values)
    if not ordered:
        return Summary()
    n = len(ordered)

    def pct(q: float) -> float:
        return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))] * scale

    return Summary(count, total / count * scale, pct(0.50), pct(0.90), pct(0.99), ordered[-1] * scale, total * scale)
