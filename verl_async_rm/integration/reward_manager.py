"""verl reward manager ``async_rm``: the RM score (computed by the executor) mixed with verl's rule score.

It runs where verl runs reward managers, inside ``RewardLoopWorker.run_single``. The RM score does not come from
here: the agent-loop worker of :class:`verl_async_rm.AsyncRMAgentLoopManager` gets it from the executor as soon as
the trajectory's agent loop ends and passes it in the ``kwargs`` of verl's ``_compute_score``, which verl copies into
``non_tensor_batch`` (``experimental/agent_loop/agent_loop.py:1004``). This manager reads it, computes the rule score
with verl's own ``NaiveRewardManager`` logic (``custom_reward_function`` or ``default_compute_score``) when the rule
is used, and returns the mix with ``rm_score`` and ``rule_score`` in ``reward_extra_info``.

The class is registered as ``async_rm`` when verl's reward-manager registry is first imported (see
:mod:`verl_async_rm.plugin`), so selecting it takes only ``reward.reward_manager.name=async_rm``.
"""

from __future__ import annotations

import logging
import math

from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

from verl_async_rm.errors import NonFiniteScoreError, RewardModelError
from verl_async_rm.integration.reward_mix import RM_ERROR_KEY, RM_SCORE_KEY, RewardMix

logger = logging.getLogger(__name__)

__all__ = ["AsyncRMRewardManager", "REWARD_MANAGER_NAME"]

REWARD_MANAGER_NAME = "async_rm"
_OWN_KEYS = ("rm_score", "rule_score")


@register(REWARD_MANAGER_NAME)
class AsyncRMRewardManager(NaiveRewardManager):
    """Mixes the trajectory's RM score with verl's rule score (see module doc); weights from ``async_rm.*``."""

    def __init__(self, config, tokenizer, compute_score, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        from verl_async_rm.settings import AsyncRMConfig

        settings = AsyncRMConfig.from_verl(config)
        self.mix: RewardMix = settings.mix
        self._drop_mode = settings.integration.on_error == "drop"
        self._combine_fn = self.mix.load_combine_fn()

    async def run_single(self, data: DataProto) -> dict:
        item = data[-1]  # multi-output agent loops: the reward belongs to the last output, as in verl
        error = item.non_tensor_batch.get(RM_ERROR_KEY)
        if error and self._drop_mode:
            return await self._dropped(data, item, str(error))
        rm_score = self._rm_score(item)
        rule_score, rule_info = 0.0, {}
        if self.mix.uses_rule:
            rule = await super().run_single(data)
            rule_score, rule_info = _finite_rule_score(rule["reward_score"], item), rule["reward_extra_info"]
        reward = self.mix.combine(
            rm_score, rule_score, data_source=item.non_tensor_batch.get("data_source"),
            extra_info=item.non_tensor_batch.get("extra_info"), fn=self._combine_fn,
        )
        extra = {("rule/" + k if k in _OWN_KEYS else k): v for k, v in rule_info.items()}
        extra.update(rm_score=rm_score, rule_score=rule_score)
        if self._drop_mode:  # every sample must carry the same keys (verl stacks them)
            extra.update(rm_dropped=0.0, rm_error="")
        return {"reward_score": reward, "reward_extra_info": extra}

    async def _dropped(self, data: DataProto, item, error: str) -> dict:
        """A trajectory whose RM score failed under ``on_error='drop'``: NaN reward, flagged.

        The NaN never reaches training: the v0 manager replaces it by the mean of the trajectory's scored group
        mates and zeroes its ``response_mask`` (or fails the step when too many were dropped).
        """
        rule_score, rule_info = 0.0, {}
        if self.mix.uses_rule:
            rule = await super().run_single(data)
            rule_score, rule_info = _finite_rule_score(rule["reward_score"], item), rule["reward_extra_info"]
        extra = {("rule/" + k if k in _OWN_KEYS else k): v for k, v in rule_info.items()}
        extra.update(rm_score=math.nan, rule_score=rule_score, rm_dropped=1.0, rm_error=error)
        return {"reward_score": math.nan, "reward_extra_info": extra}

    @staticmethod
    def _rm_score(item) -> float:
        ntb = item.non_tensor_batch
        if ntb.get(RM_SCORE_KEY) is None:
            raise RewardModelError(
                "reward_manager.name=async_rm found no RM score on this trajectory. It needs the package's agent "
                "loop: +actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                "verl_async_rm.AsyncRMAgentLoopManager"
            )
        score = float(ntb[RM_SCORE_KEY])
        if not math.isfinite(score):
            raise NonFiniteScoreError(
                f"RM score is not finite: {score!r}; the reward model returned NaN or inf for this trajectory"
            )
        return score


def _finite_rule_score(value, item) -> float:
    """The rule score as a float; NaN/inf/non-numbers raise instead of turning the reward into NaN."""
    try:
        score = float(value)
    except (TypeError, ValueError):
        score = math.nan
    if not math.isfinite(score):
        raise ValueError(
            f"the rule score of data_source={str(item.non_tensor_batch.get('data_source'))!r} is {value!r}; the rule "
            "function (reward.custom_reward_function or verl's default_compute_score) must return a finite number, "
            "or set async_rm.rule_weight=0 to use the RM score alone"
        )
    return score
