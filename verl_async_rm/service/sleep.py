"""``SleepLedger``: whether an RM service's replicas are awake, and the step's figures of their sleeps and wakes.

Owned by the RM service (``placement='policy_pool'``). Time awake and asleep is split at each :meth:`pop` (a step's
end), so an interval that spans two steps counts in each for its part.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["SleepLedger"]


class SleepLedger:
    """Awake from construction (the replicas load awake); :meth:`slept` and :meth:`woke` record each transition."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.asleep = False
        self._since = clock()
        self._reset()

    def _reset(self) -> None:
        self.awake_s = self.asleep_s = 0.0
        self.sleeps = self.wakes = 0
        self.sleep_s = self.wake_s = 0.0
        self.sleep_bytes = self.wake_bytes = 0.0

    def _advance(self) -> None:
        now = self._clock()
        if self.asleep:
            self.asleep_s += now - self._since
        else:
            self.awake_s += now - self._since
        self._since = now

    def slept(self, seconds: float, moved_bytes: float) -> None:
        """The replicas are asleep now; the sleep took ``seconds`` (wall, all replicas) and moved ``moved_bytes``."""
        self._advance()
        self.asleep = True
        self.sleeps += 1
        self.sleep_s += seconds
        self.sleep_bytes += moved_bytes

    def woke(self, seconds: float, moved_bytes: float) -> None:
        """The replicas are awake now (see :meth:`slept`)."""
        self._advance()
        self.asleep = False
        self.wakes += 1
        self.wake_s += seconds
        self.wake_bytes += moved_bytes

    def pop(self) -> dict[str, float]:
        """The figures since the previous call (the ``async_rm/`` step metrics of the RM on the policy's GPUs), then
        starts over: ``rm_awake_s``, ``rm_asleep_s``, ``rm_awake_share`` (of the step's wall time), ``sleeps``,
        ``wakes``, ``sleep_s``, ``wake_s``, ``sleep_bytes``, ``wake_bytes``."""
        self._advance()
        total = self.awake_s + self.asleep_s
        figures = {
            "rm_awake_s": self.awake_s,
            "rm_asleep_s": self.asleep_s,
            "rm_awake_share": self.awake_s / total if total > 0 else 1.0,
            "sleeps": float(self.sleeps),
            "wakes": float(self.wakes),
            "sleep_s": self.sleep_s,
            "wake_s": self.wake_s,
            "sleep_bytes": self.sleep_bytes,
            "wake_bytes": self.wake_bytes,
        }
        self._reset()
        return figures
