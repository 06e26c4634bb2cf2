"""The plugin on verl's v1 ``colocate_async`` trainer mode with ``on_error=drop``: batches of several steps overlap,
failed groups are evicted and refilled by verl's async replay buffer, and every trajectory is counted in exactly one
step. The RM is the NaN-RM; the ``poisoned`` agent loop makes a trajectory's RM score fail."""

from __future__ import annotations

import pytest
from manager_cases import running_manager

pytestmark = pytest.mark.integration

N = 2  # rollout.n
BUDGET = 0.25


@pytest.fixture(scope="module")
def async_loop(ray_local, tiny_models, nan_rm):
    from verl_async_rm.testing.v1 import V1FitLoop

    with running_manager(ray_local, tiny_models, "v1", "trainer.v1.trainer_mode=colocate_async",
                         "+async_rm.on_error=drop", f"+async_rm.drop_budget={BUDGET}",
                         rm_path=nan_rm[0]) as (manager, config):
        yield V1FitLoop(config, manager), manager


def test_overlapping_steps_count_each_trajectory_once(async_loop):
    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = async_loop
    assert manager._trainer_mode == "colocate_async"
    # as verl's colocate_async fit: a warm-up batch rolls out beside the first step's; each step adds one batch
    loop.dispatch(prompt_batch(["warm-up one", "warm-up two"]))
    steps = [loop.train_step(prompt_batch(["first", "second"]), batch_size=2),
             loop.train_step(prompt_batch(["third", "fourth"]), batch_size=2),
             loop.train_step(None, batch_size=2)]
    assert [len(s.keys) for s in steps] == [2 * N] * 3
    requests = [s.metrics["async_rm/requests"] for s in steps]
    assert sum(requests) == 6 * N  # every trajectory in exactly one step's figures, whichever step trained it
    assert [s.metrics["async_rm/scored"] for s in steps] == requests
    assert all(s.metrics["async_rm/errors"] == 0 and s.metrics["async_rm/dropped"] == 0 for s in steps)


def test_a_dropped_trajectory_takes_verls_failure_path_and_only_its_group_is_affected(async_loop):
    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = async_loop
    prompts = prompt_batch(["a", "b", "c", "d"], agent_names=["single_turn_agent"] * 3 + ["poisoned"])
    poisoned = str(prompts["uid"][3])
    batch = loop.train_step(prompts)
    sampled_groups = {key.split("_")[0] for key in batch.keys}
    assert poisoned not in sampled_groups and len(sampled_groups) == 4  # evicted, and refilled by verl
    assert set(map(str, prompts["uid"][:3])) <= sampled_groups
    assert batch.metrics["training/rollout_failure/evicted_samples"] == 1
    m = batch.metrics
    assert (m["async_rm/requests"], m["async_rm/scored"], m["async_rm/errors"], m["async_rm/dropped"]) == (
        5 * N, 4 * N, N, N)
    rewards = [batch.reward(i) for i in range(len(batch.keys))]
    assert all(r == r for r in rewards)  # no NaN, and no stand-in reward: the dropped trajectories are not there


def test_more_drops_than_the_budget_stop_the_run(async_loop):
    from verl_async_rm.errors import TrajectoryDroppedError
    from verl_async_rm.testing.v1 import prompt_batch

    loop, _ = async_loop
    prompts = prompt_batch(["x", "y"], agent_names=["poisoned", "poisoned"])
    with pytest.raises(TrajectoryDroppedError, match=rf"{2 * N} of {4 * N} trajectories of step"):
        loop.train_step(prompts)
