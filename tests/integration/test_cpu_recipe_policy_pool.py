"""``RM_PLACEMENT=policy_pool bash recipes/grpo_cpu_tiny.sh [trainer.use_v1=False]``: the RM on the policy's
(logical) GPU for two steps, on verl's v1 trainer (the plugin sleeps it in the trainer's ``on_sample_end`` and wakes it
in ``on_step_end``) and on v0 (whose fit loop gives no phase hook: the manager wakes the RM as each rollout starts and
puts it to sleep as a training batch returns, before verl updates the actor). Each step's figures hold one sleep, and
the wake that served its rollout (the first rollout finds the RM awake, as loaded)."""

from __future__ import annotations

import pytest
from conftest import require_vllm
from program_runs import Command, logged_steps, recipe_command

pytestmark = pytest.mark.integration

STEPS, TRAJECTORIES = 2, 8 * 4
#: trainer -> (its extra overrides, the prefix its fit loop logs the plugin's step metrics under)
TRAINERS = {"v1": ((), "async_rm/"), "v0": (("trainer.use_v1=False",), "timing_s/async_rm/")}


def program_command(request, trainer: str = "v0") -> Command:
    return recipe_command(request, f"cpu_recipe_{trainer}_pp", f"trainer.total_training_steps={STEPS}",
                          *TRAINERS[trainer][0], env={"RM_PLACEMENT": "policy_pool"})


def program_commands(request) -> dict[str, Command]:
    """Both runs (:mod:`program_runs` starts them beside the unit tier)."""
    return {trainer: program_command(request, trainer) for trainer in TRAINERS}


@pytest.fixture(scope="module", params=list(TRAINERS))
def steps(request, program_runs):
    require_vllm()
    trainer = request.param
    proc = program_runs.finish(f"{__name__}[{trainer}]", lambda: program_command(request, trainer))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return TRAINERS[trainer][1], logged_steps(proc.command.cwd / "metrics.jsonl")


def test_the_rm_on_the_policys_gpu_sleeps_and_wakes_each_step_and_scores_every_trajectory(steps):
    prefix, steps = steps
    assert set(steps) == {0, 1, 2}
    for step in (1, 2):
        m = steps[step]
        assert m[prefix + "requests"] == m[prefix + "scored"] == TRAJECTORIES and m[prefix + "errors"] == 0
        assert m[prefix + "sleeps"] == 1 and m[prefix + "sleep_bytes"] > 0
        assert m[prefix + "wakes"] == step - 1  # step 1 starts awake (loaded); step 2 wakes from step 1's sleep
        assert m["actor/grad_norm"] > 0 and m["timing_s/update_weights"] > 0
    # step 2: asleep from step 1's sleep through step 1's update, awake through its own rollout
    assert 0 < steps[2][prefix + "rm_awake_share"] < 1 and steps[2][prefix + "wake_bytes"] > 0
    assert steps[0]["val-async_rm/scored"] == steps[0]["val-async_rm/requests"] > 0
