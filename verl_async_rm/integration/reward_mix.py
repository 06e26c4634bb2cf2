"""How the RM score and the rule score become one reward: explicit weights, or a user function."""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["RewardMix", "RM_SCORE_KEY", "RM_ERROR_KEY", "load_callable"]

#: Key under which the agent-loop worker hands the trajectory's RM score to the reward manager (verl copies the
#: ``kwargs`` of ``_compute_score`` into ``non_tensor_batch``).
RM_SCORE_KEY = "__async_rm_score__"
#: Set instead of a score when the RM failed and ``async_rm.on_error='drop'``: the error, as text.
RM_ERROR_KEY = "__async_rm_error__"


@dataclass(frozen=True)
class RewardMix:
    """Final reward = ``rm_weight * rm_score + rule_weight * rule_score``, or ``combine_fn(...)`` when set."""

    rm_weight: float = field(default=1.0, metadata={"help": "weight of the reward-model score"})
    rule_weight: float = field(
        default=0.0,
        metadata={"help": "weight of verl's rule-based score (custom_reward_function or default_compute_score); "
                          "0 skips the rule, so data sources without a rule function work"},
    )
    combine_fn: Optional[str] = field(
        default=None,
        metadata={"help": "'package.module:function' called as fn(rm_score=, rule_score=, data_source=, "
                          "extra_info=) -> float; replaces the weighted sum"},
    )

    def __post_init__(self) -> None:
        for name in ("rm_weight", "rule_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"async_rm.{name} must be a finite number, got {value!r}; e.g. async_rm.{name}=1.0")
        if self.combine_fn is not None:
            module, _, attr = self.combine_fn.partition(":") if isinstance(self.combine_fn, str) else ("", "", "")
            if not module or not attr:
                raise ValueError(
                    f"async_rm.combine_fn must be 'package.module:function', got {self.combine_fn!r}; "
                    "e.g. +async_rm.combine_fn=my_rewards.mix:combine"
                )

    @property
    def uses_rule(self) -> bool:
        """Whether the rule score is needed at all."""
        return self.combine_fn is not None or self.rule_weight != 0

    def load_combine_fn(self) -> Optional[Callable[..., float]]:
        """Import ``combine_fn`` (None when unset); a failure raises ``ValueError`` naming ``async_rm.combine_fn``."""
        if self.combine_fn is None:
            return None
        try:
            return load_callable(self.combine_fn)
        except ValueError as exc:
            raise ValueError(
                f"async_rm.combine_fn={self.combine_fn!r}: {exc}; it must name an importable function "
                "(its package on PYTHONPATH in every Ray worker), e.g. +async_rm.combine_fn=my_rewards.mix:combine"
            ) from exc

    def combine(self, rm_score: float, rule_score: float, *, data_source: Any = None,
                extra_info: Optional[Mapping] = None, fn: Optional[Callable[..., float]] = None) -> float:
        """The final reward of one trajectory (``fn`` is the loaded ``combine_fn``, if any)."""
        if fn is None:
            return self.rm_weight * rm_score + self.rule_weight * rule_score
        value = fn(rm_score=rm_score, rule_score=rule_score, data_source=data_source, extra_info=extra_info)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(
                f"async_rm.combine_fn {self.combine_fn!r} returned {value!r}; it must return a finite float"
            )
        return float(value)


def load_callable(spec: str) -> Callable[..., Any]:
    """Import ``'package.module:attr'``; errors name the spec and what is wrong."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} of {spec!r}: {exc}") from exc
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r})") from None
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable")
    return fn
