"""What the two engines (:mod:`.transformers_engine`, :mod:`.vllm_engine`) share: the isolation of a failing row and the
load-time check's tolerance, each written once. An engine turns token ids into raw values; the kind makes scores."""

from __future__ import annotations

import logging
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from verl_async_rm.errors import RewardModelError

__all__ = ["Engine", "Row", "Generated", "differs", "check_rows"]

logger = logging.getLogger(__name__)

#: One input: its token ids, its group (GRPO siblings share one; None: none) and what is read from it: the positions
#: (process RMs), or the JSON schema its text must follow (a vLLM generate engine: a group judge's reply).
Row = tuple[list[int], Hashable | None, Any]


@dataclass(frozen=True)
class Generated:
    """What an engine that writes gave for one row: the text, the tokens it took, and why it stopped (``"length"``:
    cut at its token limit; ``"stop"``: it ended; None: not said)."""

    text: str
    tokens: int
    finish_reason: str | None = None


def differs(got: Sequence[float], reference: Sequence[float], half: bool, what: str) -> str | None:
    """None when each value is within ``0.1 * (1 + |ref|)`` of its reference for 16-bit weights (``half``), else
    ``1e-4 * (1 + |ref|)``; otherwise what differs. bf16 is that loose for a reason: on an H200 an 8B-shaped RM's
    packed rows differed from its single rows by 0.087 (a padded batch by 0.078); fp32 on CPU agrees to ~1e-7."""
    scale = 1e-1 if half else 1e-4
    if len(got) == len(reference) and all(abs(g - r) <= scale * (1 + abs(r)) for g, r in zip(got, reference)):
        return None  # a NaN fails the comparison
    return f"{what} {list(got)} differ from {list(reference)}"


def check_rows(vocab_size: int, lengths: Sequence[int]) -> list[list[int]]:
    """Seeded random token ids of ``lengths``: the inputs of every load-time check."""
    rng = random.Random(0)
    return [[rng.randrange(min(vocab_size, 1000)) for _ in range(n)] for n in lengths]


class Engine:
    """Base of the engines. A subclass implements :meth:`_run` (one call for some rows, Python values out, raising
    on any failure) and may refine :meth:`_failed`; :meth:`score_batch` then isolates a failing row by halving."""

    name = "engine"

    def score_batch(self, batch: Sequence[list[int]]) -> list[Any]:
        """One value per row, or the :class:`RewardModelError` of a row that makes the call fail."""
        return self._score_rows([(ids, None, None) for ids in batch])

    def _score_rows(self, rows: list[Row]) -> list[Any]:
        try:
            return self._run(rows)
        except Exception as err:  # noqa: BLE001 - out of memory, or a row that breaks the call: find it
            return self._isolate(rows, err)

    def _isolate(self, rows: list[Row], err: Exception) -> list[Any]:
        """The one halving routine: the call of ``rows`` raised ``err``; split it until the failing row is alone,
        the others keep their values (at most ~2 log2(n) extra calls)."""
        decided = self._failed(rows, err)
        if decided is not None:
            return decided
        if len(rows) == 1:
            logger.error("%s failed on a %d-token input: %r", self.name, len(rows[0][0]), err)
            failure = RewardModelError(f"{self.name} failed on this {len(rows[0][0])}-token input: {err!r}")
            failure.__cause__ = err
            return [failure]
        logger.warning("%s failed on %d rows (%r); retrying in halves", self.name, len(rows), err)
        half = len(rows) // 2
        return self._score_rows(rows[:half]) + self._score_rows(rows[half:])

    def _run(self, rows: list[Row]) -> list[Any]:
        raise NotImplementedError

    def _failed(self, rows: list[Row], err: Exception) -> list[Any] | None:
        """Before halving: a list of per-row results ends the isolation (or raise to end the replica)."""
        return None

    def close(self) -> None:
        """Release what the engine holds."""
