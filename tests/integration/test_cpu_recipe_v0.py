"""``bash recipes/grpo_cpu_tiny.sh trainer.use_v1=False`` on verl's v0 trainer (``RayPPOTrainer``) for two steps, with
verl's v1 trainer hidden from every process of the run (``assets/hide_verl_v1``: importing ``verl.trainer.ppo.v1``
raises, as on verl's ``neo`` branch): the plugin imports and scores without it, the actor trains, the plugin's
metrics reach verl's tracker (a training step's as ``timing_s/async_rm/*``, the validation pass's as
``val-async_rm/*``)."""

from __future__ import annotations

import os

import pytest
from conftest import TEST_ASSETS, require_vllm
from program_runs import Command, logged_steps, recipe_command

pytestmark = pytest.mark.integration

STEPS, TRAJECTORIES = 2, 8 * 4
HIDE_V1 = TEST_ASSETS / "hide_verl_v1"


def program_command(request) -> Command:
    path = os.pathsep.join(p for p in (str(HIDE_V1), os.environ.get("PYTHONPATH", "")) if p)
    return recipe_command(request, "cpu_recipe_v0", f"trainer.total_training_steps={STEPS}", "trainer.use_v1=False",
                          env={"PYTHONPATH": path})


@pytest.fixture(scope="module")
def run(request, program_runs):
    require_vllm()
    proc = program_runs.finish(__name__, lambda: program_command(request))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc, logged_steps(proc.command.cwd / "metrics.jsonl")


def test_v0_trains_two_steps_with_every_trajectory_scored_and_v1_never_imported(run):
    proc, steps = run
    assert "hidden by tests/integration/assets/hide_verl_v1" not in proc.stdout + proc.stderr
    assert set(steps) == {0, 1, 2}  # the validation before training, then the two steps
    for step in (1, 2):
        m = steps[step]
        assert m["timing_s/async_rm/requests"] == m["timing_s/async_rm/scored"] == TRAJECTORIES
        assert m["timing_s/async_rm/errors"] == 0 and m["timing_s/async_rm/batches"] >= 1
        assert m["actor/grad_norm"] > 0 and m["timing_s/update_weights"] > 0
    assert steps[0]["val-async_rm/scored"] == steps[0]["val-async_rm/requests"] > 0
    assert steps[0]["val-async_rm/errors"] == 0
