"""How the RM scores and the reward manager's own reward become one reward: explicit weights, or a user function."""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from verl_async_rm.errors import ConfigValueError, RewardModelError
from verl_async_rm.options import check_options, option
from verl_async_rm.request import Score, Verdict, score_value

_WEIGHT = {"why": "must be a finite number", "fix": "e.g. {key}=1.0"}

__all__ = ["MAIN", "RewardMix", "RM_SCORE_KEY", "RM_SCORES_KEY", "with_rm_scores"]

#: The name of the RM set by verl's ``reward.reward_model.*`` keys.
MAIN = "main"
#: ``extra_info`` keys through which the reward manager's function sees the RM scores: the main RM's raw score, and
#: every RM's raw score by name.
RM_SCORE_KEY, RM_SCORES_KEY = "rm_score", "rm_scores"


@dataclass(frozen=True)
class RewardMix:
    """Final reward = ``rule_weight * rule_score + sum over RMs of weight * score`` (``main`` weighted by
    ``rm_weight``), or ``combine_fn(...)`` when set; ``rule_score`` is the reward manager's own reward."""

    rm_weight: float = option(1.0, "weight of the main RM's score (reward.reward_model.*)", **_WEIGHT)
    rule_weight: float = option(
        0.0, "weight of the reward manager's own reward (verl's rule, custom_reward_function...). Default 0.0 with "
        "reward_manager.name=async_rm (the rule is then skipped), 1.0 with any other manager", **_WEIGHT)
    combine_fn: Optional[str] = option(
        None, "'package.module:function' called as fn(rm_score=, rule_score=, data_source=, extra_info=, rm_scores=) "
        "-> float instead of the weighted sum (rm_scores: RM name -> score; required with async_rm.models)",
        str, optional=True, fix="e.g. +async_rm.combine_fn=my_rewards.mix:combine")
    #: Weights of the RMs of ``async_rm.models`` (name, weight), set from them; not a user key.
    extra_weights: tuple[tuple[str, float], ...] = field(default=(), metadata={"internal": True})
    #: Names of the RMs whose scores are token-level (process RMs with ``process_reduction='none'``); not a user key.
    token_level_rms: tuple[str, ...] = field(default=(), metadata={"internal": True})
    #: Names of the judges that write their verdict (``judge_readout='generate'``), whose text goes into
    #: ``reward_extra_info`` as ``rm_verdict_<name>``; not a user key.
    verdict_rms: tuple[str, ...] = field(default=(), metadata={"internal": True})
    #: Names of the group judges (``reward_kind='group_judge'``), told of a trajectory that will never come; not a
    #: user key.
    group_rms: tuple[str, ...] = field(default=(), metadata={"internal": True})

    def __post_init__(self) -> None:
        check_options(self, prefix="async_rm.")
        if self.combine_fn is not None and self.token_level_rms:
            raise ValueError(
                f"async_rm.combine_fn={self.combine_fn!r} cannot be used with token-level rewards (RM(s) "
                f"{', '.join(self.token_level_rms)} with process_reduction=none): combine_fn returns one number, "
                "while step rewards are placed on their tokens by weight. Fix: remove async_rm.combine_fn, or set "
                "process_reduction to min, mean, last or product")
        module, _, attr = (self.combine_fn or ":").partition(":")
        if self.combine_fn is not None and not (module and attr):
            raise ConfigValueError("async_rm.combine_fn", self.combine_fn, "must be 'package.module:function'",
                                   "e.g. +async_rm.combine_fn=my_rewards.mix:combine")

    @property
    def uses_rule(self) -> bool:
        return self.combine_fn is not None or self.rule_weight != 0

    @property
    def token_level(self) -> bool:
        """Whether some RM's scores are token-level (its step rewards are placed on their tokens)."""
        return bool(self.token_level_rms)

    @property
    def weights(self) -> dict[str, float]:
        """RM name -> weight, ``main`` first."""
        return {MAIN: self.rm_weight, **dict(self.extra_weights)}

    def extra_keys(self, flag_drops: bool) -> tuple[str, ...]:
        """The keys :meth:`finish` adds to every trajectory's ``reward_extra_info`` (the manager's own keep theirs)."""
        return (RM_SCORE_KEY, *(f"rm_score_{name}" for name in self.weights), "rm_total",
                *(("rule_score",) if self.uses_rule else ()), *(f"rm_verdict_{name}" for name in self.verdict_rms),
                *(("rm_dropped", "rm_error") if flag_drops else ()))

    def load_combine_fn(self) -> Optional[Callable[..., float]]:
        """Import ``combine_fn`` (None when unset; ``ValueError`` naming ``async_rm.combine_fn``). A function without an
        ``rm_scores`` parameter is called without it, and refused when there are several RMs."""
        if self.combine_fn is None:
            return None
        module_name, _, attr = self.combine_fn.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
            problem = None if callable(fn) else "is not callable"
        except ImportError as exc:
            problem = f"cannot import module {module_name!r}: {exc}"
        except AttributeError:
            problem = f"module {module_name!r} has no attribute {attr!r}"
        if problem is not None:
            raise ValueError(
                f"async_rm.combine_fn={self.combine_fn!r}: {problem}; it must name an importable function (its package "
                "on PYTHONPATH in every Ray worker), e.g. +async_rm.combine_fn=my_rewards.mix:combine")
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: pass everything
            return fn
        if any(p.name == "rm_scores" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return fn
        if self.extra_weights:
            raise ValueError(
                f"async_rm.combine_fn={self.combine_fn!r} takes no rm_scores parameter, so the scores of "
                f"async_rm.models ({', '.join(n for n, _ in self.extra_weights)}) would never reach the reward. Fix: "
                "add rm_scores=None to its signature (a dict: RM name -> raw score, 'main' included)")
        return lambda *, rm_scores=None, **kwargs: fn(**kwargs)

    def rm_total(self, rm_scores: Mapping[str, float]) -> float:
        """The weighted sum of the RM scores (every RM of the run must be there)."""
        return sum(weight * rm_scores[name] for name, weight in self.weights.items())

    def combine(self, rm_score: float, rule_score: float, *, rm_scores: Optional[Mapping[str, float]] = None,
                data_source: Any = None, extra_info: Optional[Mapping] = None,
                fn: Optional[Callable[..., float]] = None) -> float:
        """The final reward of one trajectory (``fn``: the loaded ``combine_fn``, if any; ``rm_scores``: every RM's
        raw score by name, default ``main`` only)."""
        scores = dict(rm_scores) if rm_scores is not None else {MAIN: rm_score}
        if fn is None:  # a rule weighted 0 did not run: its score is not a number to multiply
            return self.rm_total(scores) + (self.rule_weight * rule_score if self.rule_weight else 0.0)
        value = fn(rm_score=rm_score, rule_score=rule_score, data_source=data_source, extra_info=extra_info,
                   rm_scores=scores)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(
                f"async_rm.combine_fn {self.combine_fn!r} returned {value!r}; it must return a finite float")
        return float(value)

    def finish(self, manager_result: Mapping[str, Any], rm_scores: Mapping[str, Score], *, data_source: Any = None,
               extra_info: Optional[Mapping] = None, fn: Optional[Callable[..., float]] = None,
               error: Optional[str] = None, flag_drops: bool = False) -> tuple[float, dict[str, Any]]:
        """The trajectory's reward and ``reward_extra_info`` from its reward manager's result and its RM scores.

        ``manager_result``: verl's reward manager's ``reward_score`` and ``reward_extra_info``, empty when the reward
        uses no rule (the manager did not run). ``reward_extra_info`` keeps the manager's keys (one clashing with ours
        becomes ``rule/<key>``) and adds ``rm_score``, ``rm_score_<name>``, ``rm_total``, ``rule_score`` (when the
        reward uses the rule) and ``rm_verdict_<name>`` ("" when none: verl stacks the keys of all samples).
        ``error`` (v0, ``on_error='drop'``): the reward is NaN, never a partial sum, flagged by ``rm_dropped`` and
        ``rm_error``, which ``flag_drops`` adds to every trajectory."""
        manager_info = dict(manager_result.get("reward_extra_info") or {})
        raw_rule = manager_result.get("reward_score")
        missing = [name for name in self.weights if name not in rm_scores]
        if missing and error is None:
            raise RewardModelError(
                f"no score from RM(s) {missing}: every RM of the run must score the trajectory (a partial sum never "
                "becomes a reward)")
        scores = {name: score_value(rm_scores[name]) if name in rm_scores else math.nan for name in self.weights}
        rule_score = math.nan  # reported only when the reward uses the manager's (else the manager did not run)
        if self.uses_rule:
            try:
                rule_score = float(raw_rule)
            except (TypeError, ValueError):
                pass  # not a number: NaN
            if error is None and not math.isfinite(rule_score):  # NaN, inf or not a number: raised, never a reward
                raise ValueError(
                    f"the reward manager's reward for data_source={str(data_source)!r} is {raw_rule!r}; the reward "
                    "function (reward.custom_reward_function or verl's default_compute_score) must return a finite "
                    "number, or set async_rm.rule_weight=0 to leave the manager's reward out")
        reward = total = math.nan
        if error is None:
            total = self.rm_total(scores)
            reward = self.combine(scores[MAIN], rule_score, rm_scores=scores, data_source=data_source,
                                  extra_info=extra_info, fn=fn)
        own = {RM_SCORE_KEY: scores[MAIN], **{f"rm_score_{name}": s for name, s in scores.items()},
               "rm_total": total, **({"rule_score": rule_score} if self.uses_rule else {})}
        own.update({f"rm_verdict_{name}": s.text if isinstance(s := rm_scores.get(name), Verdict) else ""
                    for name in self.verdict_rms})
        if flag_drops or error is not None:
            own.update(rm_dropped=float(error is not None), rm_error=error or "")
        extra = {(f"rule/{k}" if k in own else k): v for k, v in manager_info.items()}
        extra.update(own)
        return reward, extra


def with_rm_scores(extra_info: Any, rm_scores: Mapping[str, Score]) -> dict[str, Any]:
    """A copy of the trajectory's ``extra_info`` with ``rm_score`` (main) and ``rm_scores`` (by name) added as
    numbers, for the reward manager's function (verl's managers pass ``extra_info`` to it)."""
    info = dict(extra_info) if isinstance(extra_info, Mapping) else {}
    if clash := sorted({RM_SCORE_KEY, RM_SCORES_KEY} & info.keys()):  # the start's check reads parquet files only
        raise ValueError(
            f"the trajectory's extra_info already holds {clash}, the key(s) through which the plugin hands the RM "
            "scores to the reward function: the dataset's value would be lost. Fix: rename that field of your "
            "dataset's extra_info")
    values = {name: score_value(s) for name, s in rm_scores.items()}
    info[RM_SCORE_KEY] = values.get(MAIN, math.nan)
    info[RM_SCORES_KEY] = values
    return info

