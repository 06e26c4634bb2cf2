"""What happened to each trajectory's RM score in one agent-loop worker, per phase (``train``, ``val``), until the
manager collects it at the end of the step (v1: a failed trajectory never reaches TransferQueue, so this is where it
is counted). A trajectory counts when its outcome is known: in the async trainer modes, in the step of its answer.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

__all__ = ["Failure", "PhaseRecord", "TrajectoryLedger", "PHASES"]

PHASES = ("train", "val")
#: Failures kept in full per phase between two collections (the rest are only counted): enough to name the first
#: ones in an error message without holding every traceback of a step where the RM is down.
_KEEP_FAILURES = 32


@dataclass(frozen=True)
class Failure:
    """One trajectory that got no RM score: its id (``<uid>/<session>``), its step, the error (``Type: message``)
    and, where it survives pickling, the exception itself (the cause of ``RMScoreError``)."""

    trajectory: str
    global_steps: int | None
    error: str
    cause: BaseException | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def portable(err: BaseException) -> BaseException | None:
        """``err``, or None if it does not pickle (the record travels to the manager)."""
        try:
            pickle.dumps(err)
        except Exception:  # noqa: BLE001 - an unpicklable exception keeps only its text
            return None
        return err

    def __str__(self) -> str:
        step = "" if self.global_steps is None else f" (step {self.global_steps})"
        return f"trajectory {self.trajectory}{step}: {self.error}"


@dataclass
class PhaseRecord:
    """Counts of one phase since the last collection (``requests = scored + failed``); ``failures`` holds the first
    few in full."""

    requests: int = 0
    scored: int = 0
    failed: int = 0
    failures: list[Failure] = field(default_factory=list)

    def merge(self, other: PhaseRecord) -> PhaseRecord:
        """This record plus ``other`` (the manager adds up its workers' records); keeps the first failures."""
        return PhaseRecord(
            requests=self.requests + other.requests,
            scored=self.scored + other.scored,
            failed=self.failed + other.failed,
            failures=(self.failures + other.failures)[:_KEEP_FAILURES],
        )


class TrajectoryLedger:
    """Per-phase :class:`PhaseRecord` of one worker; :meth:`pop` hands one phase over and starts it again."""

    def __init__(self) -> None:
        self._records = {phase: PhaseRecord() for phase in PHASES}

    def scored(self, phase: str) -> None:
        """A trajectory of ``phase`` got its RM score."""
        record = self._records[phase]
        record.requests += 1
        record.scored += 1

    def failed(self, phase: str, failure: Failure) -> None:
        """A trajectory of ``phase`` got no RM score (an RM, executor or timeout error)."""
        record = self._records[phase]
        record.requests += 1
        record.failed += 1
        if len(record.failures) < _KEEP_FAILURES:
            record.failures.append(failure)

    def pop(self, phase: str) -> PhaseRecord:
        """The record of ``phase`` since the previous pop; the phase starts again from zero."""
        record, self._records[phase] = self._records[phase], PhaseRecord()
        return record
