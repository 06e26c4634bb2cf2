"""What a failed RM score does to a step: each worker records its trajectories' outcomes per phase
(:class:`PhaseRecords`), then :func:`check_failures` applies ``on_error`` at a step's end, on both trainers; on v0
:func:`apply_drops` also excludes the dropped trajectories from the batch: their ``response_mask`` zeroed, their NaN
reward replaced by their group's mean, so GRPO's baseline does not move (on v1, verl left their group out already).
Never a silent 0.0 standing in for a score."""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl_async_rm.errors import RMScoreError, TrajectoryDroppedError

logger = logging.getLogger(__name__)

__all__ = ["apply_drops", "check_failures", "Failure", "PhaseRecord", "PhaseRecords", "PHASES"]

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
        return PhaseRecord(requests=self.requests + other.requests, scored=self.scored + other.scored,
                           failed=self.failed + other.failed,
                           failures=(self.failures + other.failures)[:_KEEP_FAILURES])


class PhaseRecords:
    """One worker's :class:`PhaseRecord` per phase; :meth:`pop` hands one phase over and starts it again."""

    def __init__(self) -> None:
        self._records = {phase: PhaseRecord() for phase in PHASES}

    def scored(self, phase: str) -> None:
        """A trajectory of ``phase`` got its RM score."""
        record = self._records[phase]
        record.requests += 1
        record.scored += 1

    def failed(self, phase: str, failure: Failure) -> None:
        """A trajectory of ``phase`` got no RM score (an RM, batcher or timeout error)."""
        record = self._records[phase]
        record.requests += 1
        record.failed += 1
        if len(record.failures) < _KEEP_FAILURES:
            record.failures.append(failure)

    def pop(self, phase: str) -> PhaseRecord:
        """The record of ``phase`` since the previous pop; the phase starts again from zero."""
        record, self._records[phase] = self._records[phase], PhaseRecord()
        return record


def check_failures(record: Any, integration: Any, where: str) -> None:
    """Apply ``on_error`` to a phase's record: :class:`RMScoreError` (``raise``) if a trajectory got no RM score,
    :class:`TrajectoryDroppedError` (``drop``) if more than ``drop_budget`` of the phase got none."""
    if not record.failed:
        return
    first = "; ".join(str(f) for f in record.failures[:3])
    cause = next((f.cause for f in record.failures if f.cause is not None), None)
    if integration.on_error != "drop":
        raise RMScoreError(
            f"{record.failed} of {record.requests} trajectories of {where} got no RM score (async_rm.on_error=raise); "
            f"{first}. verl gave their groups its failure path, so nothing was trained on them. Fix: find why the RM "
            "failed (these errors, the RM replicas' logs), or set +async_rm.on_error=drop to go on without them "
            "within async_rm.drop_budget") from cause
    if record.failed > integration.drop_budget * record.requests:
        raise TrajectoryDroppedError(
            f"{record.failed} of {record.requests} trajectories of {where} got no RM score, more than "
            f"async_rm.drop_budget={integration.drop_budget:g} allows; {first}. Fix: find why the RM fails (these "
            "errors, the RM replicas' logs), or raise async_rm.drop_budget") from cause
    logger.warning("verl_async_rm: %d of %d trajectories of %s dropped (no RM score): %s", record.failed,
                   record.requests, where, first)


def apply_drops(output: Any, uids: Any = None) -> int:
    """Exclude the dropped trajectories of ``output`` (a verl ``DataProto``; the budget is checked by
    :func:`check_failures`): their ``response_mask`` zeroed, the NaN the reward manager gave them replaced by their
    group's mean. Whole columns are assigned, not edited in place (a ``DataProto`` view may hand out copies). Returns
    how many there were. ``uids``: the rows' groups (the input batch's ``uid``: verl's v0 output does not carry it
    when a reward loop runs); default: ``output``'s own ``uid``, if any."""
    ntb = output.non_tensor_batch
    dropped = np.asarray(ntb["rm_dropped"], dtype=np.float64) > 0.5 if "rm_dropped" in ntb else np.zeros(0, bool)
    if not dropped.any():
        return 0
    scores, mask = output.batch["rm_scores"].clone(), output.batch["response_mask"].clone()
    totals = torch.nan_to_num(scores.float(), nan=0.0).sum(dim=-1)
    uids = uids if uids is not None else ntb.get("uid")
    for i in np.flatnonzero(dropped):
        mates = [j for j in range(len(dropped)) if not dropped[j] and (uids is None or uids[j] == uids[i])]
        fill = float(totals[mates].mean()) if mates else 0.0  # no mate: the row is masked out, its value unread
        scores[i][torch.isnan(scores[i])] = fill  # the NaN the reward manager put at the last response token
        mask[i] = 0
    output.batch["rm_scores"], output.batch["response_mask"] = scores, mask
    logger.warning("verl_async_rm: %d of %d trajectories dropped (no RM score); excluded from the loss",
                   int(dropped.sum()), len(dropped))
    return int(dropped.sum())
