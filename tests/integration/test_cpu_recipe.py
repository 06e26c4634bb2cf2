"""``bash recipes/grpo_cpu_tiny.sh trainer.total_training_steps=2`` runs verl's own ``python -m
verl.trainer.main_ppo`` to the end on this CPU-only machine, as a user runs it: its own Ray cluster, the demo's tiny
models and data (nothing set), verl's vLLM rollout, FSDP2 actor with the reference model, and the plugin scoring."""

from __future__ import annotations

import json

import pytest
from conftest import require_vllm
from program_runs import Command, recipe_command

pytestmark = pytest.mark.integration

STEPS, TRAJECTORIES = 2, 8 * 4  # the recipe's 8 prompts x 4 responses


def program_command(request) -> Command:
    """The recipe for two steps (:mod:`program_runs`: the session starts it beside the unit tier)."""
    return recipe_command(request, "cpu_recipe", f"trainer.total_training_steps={STEPS}")


@pytest.fixture(scope="module")
def recipe_run(request, program_runs):
    require_vllm()
    proc = program_runs.finish(__name__, lambda: program_command(request))
    return proc, proc.command.cwd / "metrics.jsonl"


def test_the_recipe_runs_verls_main_ppo_to_the_end(recipe_run):
    proc, metrics = recipe_run
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = {row["step"]: row["data"] for row in rows}
    assert set(steps) == {0, 1, 2}  # validation before training, then the two steps


def test_every_trajectory_was_scored_and_the_policy_trained(recipe_run):
    _, metrics = recipe_run
    steps = {row["step"]: row["data"] for row in map(json.loads, metrics.read_text().splitlines())}
    assert steps[0]["val-async_rm/scored"] == steps[0]["val-async_rm/requests"] > 0
    for step in (1, 2):
        m = steps[step]
        assert m["async_rm/requests"] == m["async_rm/scored"] == TRAJECTORIES and m["async_rm/errors"] == 0
        assert m["actor/grad_norm"] > 0 and "actor/kl_loss" in m and m["timing_s/ref"] > 0
        assert m["timing_s/update_weights"] > 0 and abs(m["rollout_corr/kl"]) < 1e-4  # the rollout has the update
    assert steps[2]["actor/kl_loss"] > 0  # the actor moved away from the reference model after step 1
