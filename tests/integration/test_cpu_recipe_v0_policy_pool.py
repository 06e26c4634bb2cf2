"""``RM_PLACEMENT=policy_pool bash recipes/grpo_cpu_tiny.sh trainer.use_v1=False``: the RM on the policy's (logical)
GPU on verl's v0 trainer for two steps. verl's v0 fit loop gives the manager no phase hook: the manager wakes the RM as
each rollout starts and puts it to sleep as a training batch returns, before verl updates the actor; each step's
figures hold its sleep, and the wake that served its rollout (the first rollout finds the RM awake, as loaded). The v1
trainer's run with this placement: ``test_cpu_recipe_policy_pool_remote.py``."""

from __future__ import annotations

import pytest
from conftest import require_vllm
from program_runs import Command, logged_steps, recipe_command

pytestmark = pytest.mark.integration

STEPS, TRAJECTORIES = 2, 8 * 4


def program_command(request) -> Command:
    return recipe_command(request, "cpu_recipe_v0_pp", f"trainer.total_training_steps={STEPS}",
                          "trainer.use_v1=False", env={"RM_PLACEMENT": "policy_pool"})


@pytest.fixture(scope="module")
def steps(request, program_runs):
    require_vllm()
    proc = program_runs.finish(__name__, lambda: program_command(request))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return logged_steps(proc.command.cwd / "metrics.jsonl")


def test_the_rm_on_the_policys_gpu_sleeps_and_wakes_each_v0_step_and_scores_every_trajectory(steps):
    assert set(steps) == {0, 1, 2}
    for step in (1, 2):
        m = steps[step]
        assert m["timing_s/async_rm/requests"] == m["timing_s/async_rm/scored"] == TRAJECTORIES
        assert m["timing_s/async_rm/errors"] == 0
        assert m["timing_s/async_rm/sleeps"] == 1 and m["timing_s/async_rm/sleep_bytes"] > 0
        assert m["timing_s/async_rm/wakes"] == step - 1  # step 1 starts awake (loaded); step 2 wakes from step 1's
        assert m["actor/grad_norm"] > 0 and m["timing_s/update_weights"] > 0
    # step 2: asleep from step 1's sleep through step 1's update, awake through its own rollout
    assert 0 < steps[2]["timing_s/async_rm/rm_awake_share"] < 1 and steps[2]["timing_s/async_rm/wake_bytes"] > 0
    assert steps[0]["val-async_rm/scored"] == steps[0]["val-async_rm/requests"] > 0
