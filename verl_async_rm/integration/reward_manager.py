"""verl reward manager ``async_rm``: verl's ``NaiveRewardManager`` that runs the rule only when the reward uses it
(``rule_weight`` or ``combine_fn``), so data sources without a rule work with the RM alone."""

from __future__ import annotations


from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

from verl_async_rm.errors import RewardModelError
from verl_async_rm.integration.reward_mix import RM_SCORE_KEY
from verl_async_rm.config import ASYNC_RM_MANAGER

__all__ = ["AsyncRMRewardManager"]


@register(ASYNC_RM_MANAGER)
class AsyncRMRewardManager(NaiveRewardManager):
    """verl's naive manager, whose rule runs only when ``async_rm.*`` weights use it (see module doc)."""

    def __init__(self, config, tokenizer, compute_score, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        from verl_async_rm.config import AsyncRMConfig

        self._uses_rule = AsyncRMConfig.from_verl(config).mix.uses_rule

    async def run_single(self, data: DataProto) -> dict:
        item = data[-1]  # multi-output agent loops: the reward belongs to the last output, as in verl
        extra_info = item.non_tensor_batch.get("extra_info")
        if not isinstance(extra_info, dict) or RM_SCORE_KEY not in extra_info:
            raise RewardModelError(
                "reward_manager.name=async_rm found no RM score on this trajectory. It needs the package's agent "
                "loop: +actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                "verl_async_rm.AsyncRMAgentLoopManager")
        if not self._uses_rule:
            return {"reward_score": 0.0, "reward_extra_info": {}}
        return await super().run_single(data)
