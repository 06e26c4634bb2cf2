"""verl's ``naive`` reward manager that counts its calls in the named actor ``reward_loop_calls`` (when the test made
one): each call is one Ray call of an agent-loop worker to verl's reward-loop worker (``RewardLoopWorker.compute_score``
runs the manager once per trajectory). Loaded by verl from this file (``reward.reward_manager.source=importlib``)."""

from __future__ import annotations

import ray
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager


class CountingRewardManager(NaiveRewardManager):
    async def run_single(self, data):
        await ray.get_actor("reward_loop_calls").add.remote()
        return await super().run_single(data)
