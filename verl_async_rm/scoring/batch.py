"""A batch of items through one kind, the one path of every engine: each item's input built (:class:`KindBatch`: an
item whose input cannot be built gets its error), then the engine's raw values read into one result per item, with
the batch's counters (:class:`ScorerStats`). A replica's scorer runs it around its local engine, an endpoint's slots
around the endpoint engine."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from verl_async_rm.errors import JudgeVerdictError, RewardInputError
from verl_async_rm.request import ScoreResult
from verl_async_rm.scoring.engine import Generated
from verl_async_rm.scoring.outcome import Kind, RMInput

logger = logging.getLogger(__name__)

__all__ = ["KindBatch", "ScorerStats", "stat_names"]


@dataclasses.dataclass
class ScorerStats:
    """An RM's counters over some batches (a replica's since load or per step): what a kind scored and how."""

    requests: int = 0
    failed: int = 0  #: requests that got an error (bad input, NaN/inf score, a forward that failed for them)
    truncated: int = 0  #: inputs cut to max_length
    tokens: int = 0  #: RM input tokens built (estimated for a server that renders the input)
    busy_s: float = 0.0  #: seconds inside score()
    steps_dropped: int | None = None  #: process RMs only: leading steps left unscored (input beyond max_length)
    judge_tokens: int | None = None  #: judges that write, and pairwise judges: tokens the judge wrote
    judge_parse_failures: int | None = None  #: judges that write, and pairwise judges: replies that did not read
    judge_cut_replies: int | None = None  #: judges that write, and pairwise judges: replies cut at judge_max_tokens


def stat_names(config: Any) -> tuple[str, ...]:
    """The :class:`ScorerStats` fields an RM of ``config`` counts (the others stay None)."""
    names = ("requests", "failed", "truncated", "tokens", "busy_s")
    if config.writes or config.reward_kind == "pairwise_judge":
        return (*names, "judge_tokens", "judge_parse_failures", "judge_cut_replies")
    return (*names, "steps_dropped") if config.reward_kind == "process" else names


class KindBatch:
    """``items`` built by ``kind``: :attr:`inputs` for the engine (the items that built), then :meth:`read`."""

    def __init__(self, kind: Kind, items: Sequence[Any]) -> None:
        self.kind, self.items = kind, list(items)
        self.results: list[ScoreResult | None] = [None] * len(items)
        self.inputs: list[RMInput] = []
        self._owners: list[int] = []
        for i, item in enumerate(items):
            try:
                self.inputs.append(kind.build(item))
                self._owners.append(i)
            except RewardInputError as err:
                self.results[i] = err
            except Exception as err:  # a tokenizer or template failure belongs to this item only
                self.results[i] = RewardInputError(f"{_name(item)}: cannot build RM input: {err!r}")
                self.results[i].__cause__ = err

    @property
    def groups(self) -> list[Any]:
        """Each input's GRPO group (siblings share a prompt an engine may run once)."""
        return [getattr(self.items[i], "group", None) for i in self._owners]

    def read(self, raws: Sequence[Any]) -> tuple[list[ScoreResult], dict[str, float]]:
        """One result per item from the engine's raw value of each input (an ``Exception`` fails its item), and the
        batch's counts (:func:`stat_names` of the kind's config)."""
        kind, names = self.kind, stat_names(self.kind.config)
        for i, built, raw in zip(self._owners, self.inputs, raws, strict=True):
            self.results[i] = raw if isinstance(raw, Exception) else kind.read(self.items[i], raw, built)
        results: list[ScoreResult] = self.results  # type: ignore[assignment] - every entry is set now
        counts = {"requests": len(results), "failed": sum(isinstance(r, Exception) for r in results),
                  "truncated": sum(b.truncated for b in self.inputs), "tokens": sum(b.num_tokens for b in self.inputs)}
        if "steps_dropped" in names:
            counts["steps_dropped"] = sum(b.dropped for b in self.inputs)
            if counts["steps_dropped"]:
                logger.warning("process RM: %d leading step(s) left unscored: their input exceeded max_length=%s "
                               "even without the prompt", counts["steps_dropped"], kind.max_length)
        if "judge_tokens" in names:
            written = [raw for raw in raws if isinstance(raw, Generated)]
            counts.update(judge_tokens=sum(g.tokens for g in written),
                          judge_cut_replies=sum(g.finish_reason == "length" for g in written),
                          judge_parse_failures=sum(isinstance(r, JudgeVerdictError) for r in results))
        return results, counts


def _name(item: Any) -> str:
    uid = str(getattr(item, "uid", "?"))
    return uid if uid.startswith("group ") else f"trajectory {uid}"
