"""verl reward manager ``async_rm``: verl's ``NaiveRewardManager`` (the rule, on data sources that have one) for
trajectories the plugin's agent-loop workers scored. It runs only when the reward uses the rule (``rule_weight`` or
``combine_fn``): otherwise the workers set the reward themselves and verl's reward loop is not called."""

from __future__ import annotations

from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

from verl_async_rm.config import ASYNC_RM_MANAGER
from verl_async_rm.errors import RewardModelError
from verl_async_rm.reward_mix import RM_SCORE_KEY

__all__ = ["AsyncRMRewardManager"]


@register(ASYNC_RM_MANAGER)
class AsyncRMRewardManager(NaiveRewardManager):
    """verl's naive manager, refusing trajectories the plugin did not score (see module doc)."""

    async def run_single(self, data: DataProto) -> dict:
        item = data[-1]  # multi-output agent loops: the reward belongs to the last output, as in verl
        extra_info = item.non_tensor_batch.get("extra_info")
        if not isinstance(extra_info, dict) or RM_SCORE_KEY not in extra_info:
            raise RewardModelError(
                "reward_manager.name=async_rm found no RM score on this trajectory. It needs the package's agent "
                "loop: +actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                "verl_async_rm.AsyncRMAgentLoopManager")
        return await super().run_single(data)
