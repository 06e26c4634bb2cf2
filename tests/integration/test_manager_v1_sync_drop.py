"""``on_error=drop`` on verl's v1 ``sync`` trainer mode, which needs ``trainer.v1.sampler.sync_refill_failed_groups``:
a group whose every trajectory lost its RM score takes verl's failure path and is refilled by verl's sync replay
buffer with a fresh prompt; the step goes on, counts the drops, and nothing is trained on a missing score."""

from __future__ import annotations

import pytest
from manager_cases import running_manager

pytestmark = pytest.mark.integration

N = 2  # rollout.n


def test_a_failed_group_is_refilled_by_verls_sync_replay_buffer(ray_local, tiny_models, nan_rm):
    from verl_async_rm.testing.v1 import V1FitLoop, prompt_batch

    with running_manager(ray_local, tiny_models, "v1", "+async_rm.on_error=drop", "+async_rm.drop_budget=0.5",
                         "trainer.v1.sampler.sync_refill_failed_groups=True",
                         rm_path=nan_rm[0]) as (manager, config):
        assert manager._trainer_mode == "sync"
        loop = V1FitLoop(config, manager)
        prompts = prompt_batch(["fine", "poisoned"], agent_names=["single_turn_agent", "poisoned"])
        batch = loop.train_step(prompts)
        groups = {key.split("_")[0] for key in batch.keys}
        assert str(prompts["uid"][0]) in groups and str(prompts["uid"][1]) not in groups and len(groups) == 2
        assert len(batch.keys) == 2 * N and all(batch.reward(i) == batch.reward(i) for i in range(2 * N))
        m = batch.metrics
        assert (m["async_rm/requests"], m["async_rm/scored"], m["async_rm/dropped"]) == (3 * N, 2 * N, N)
