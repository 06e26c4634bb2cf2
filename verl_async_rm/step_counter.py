"""The one per-step counter helper: named counts kept since the start and since the last step boundary
(:class:`StepCounter`), for every component that reports a step's stats (the batcher, the group gate, a replica's
scorer, the endpoint client, the sleep of replicas on the policy's GPUs, a pairwise judge's comparisons). Samples of
a time or a size are :class:`~verl_async_rm.percentiles.Samples`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["StepCounter"]


class StepCounter:
    """Counts by name since the start and since the last :meth:`pop_step` (one step). Each name given at
    construction is an attribute (``counter.submitted += 1``: one attribute update, as cheap as a plain counter on
    the batcher's hot path); :meth:`add` counts by a name held in a variable."""

    def __init__(self, names: Iterable[str]) -> None:
        self.__dict__.update(dict.fromkeys(names, 0))
        self._names = tuple(n for n in self.__dict__)
        self._base = self.totals()  # the totals at the last step boundary

    def add(self, name: str, n: float = 1) -> None:
        """Count ``n`` more of ``name`` (an ``AttributeError`` for a name not given at construction)."""
        if name not in self._names:
            raise AttributeError(f"StepCounter has no count {name!r}; it counts {self._names}")
        self.__dict__[name] += n

    def add_all(self, counts: Mapping[str, float]) -> None:
        for name, n in counts.items():
            self.add(name, n)

    def __getitem__(self, name: str) -> float:
        if name not in self._names:
            raise KeyError(name)
        return self.__dict__[name]

    def totals(self) -> dict[str, float]:
        """Every count since the start."""
        return {name: self.__dict__[name] for name in self._names}

    def pop_step(self) -> dict[str, float]:
        """This step's counts; the next step starts at zero."""
        totals, base = self.totals(), self._base
        self._base = totals
        return {name: total - base[name] for name, total in totals.items()}
