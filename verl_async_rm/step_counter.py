"""The one per-step counter helper: named counts kept since the start and since the last step boundary
(:class:`StepCounter`), for every component that reports a step's stats (the batcher, the group gate, a replica's
scorer, the endpoint client, the sleep of replicas on the policy's GPUs). Samples of a time or a size are
:class:`~verl_async_rm.percentiles.Samples`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["StepCounter"]


class StepCounter:
    """Counts by name since the start (``counter[name]``, :meth:`totals`) and since the last :meth:`pop` (one
    step); only the names given at construction exist."""

    __slots__ = ("_total", "_step")

    def __init__(self, names: Iterable[str]) -> None:
        self._total: dict[str, float] = dict.fromkeys(names, 0)
        self._step = dict(self._total)

    def add(self, name: str, n: float = 1) -> None:
        """Count ``n`` more of ``name`` (a ``KeyError`` for a name not given at construction)."""
        self._total[name] += n
        self._step[name] += n

    def add_all(self, counts: Mapping[str, float]) -> None:
        for name, n in counts.items():
            self.add(name, n)

    def __getitem__(self, name: str) -> float:
        return self._total[name]

    def totals(self) -> dict[str, float]:
        """Every count since the start (a copy)."""
        return dict(self._total)

    def pop(self) -> dict[str, float]:
        """This step's counts; the next step starts at zero."""
        step, self._step = self._step, dict.fromkeys(self._step, 0)
        return step
