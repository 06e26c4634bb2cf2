"""``bash recipes/grpo_cpu_tiny.sh trainer.total_training_steps=2`` runs verl's own ``python -m
verl.trainer.main_ppo`` to the end on this CPU-only machine, as a user runs it: its own Ray cluster, the demo's tiny
models and data (nothing set), verl's vLLM rollout, FSDP2 actor with the reference model, and the plugin scoring.
Beside the recipe's RM, an extra RM ``group`` is a group judge (``reward_kind=group_judge``: one call per GRPO group
of 4) on a local vLLM engine with structured output: the tiny ``json`` judge (``testing/judges.py``) gives every label
:data:`~verl_async_rm.testing.judges.JSON_DIGIT`, so every trajectory's ``rm_score_group`` is known."""

from __future__ import annotations

import json

import pytest
from conftest import require_vllm
from program_runs import Command, recipe_command

pytestmark = pytest.mark.integration

STEPS, TRAJECTORIES, GROUPS = 2, 8 * 4, 8  # the recipe's 8 prompts x 4 responses
SCALE = 10


def program_command(request) -> Command:
    """The recipe for two steps with the group judge (:mod:`program_runs`: the session starts it beside the unit
    tier); the demo's replay buffer records each trajectory's ``reward_extra_info``."""
    from verl_async_rm.demo.sampler import TimedReplayBuffer
    from verl_async_rm.testing.replay_buffer import short_poll_overrides

    judge = request.getfixturevalue("tiny_judges").json
    group = [f"+async_rm.models.group.{key}={value}" for key, value in (
        ("model_path", judge), ("reward_kind", "group_judge"), ("judge_max_tokens", 48), ("judge_scale", SCALE),
        ("weight", 0.1))]
    return recipe_command(request, "cpu_recipe", f"trainer.total_training_steps={STEPS}", *group,
                          *short_poll_overrides("sync", cls=TimedReplayBuffer),
                          "+trainer.v1.sampler.sampler_kwargs.record_path=trajectories.jsonl")


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


def test_a_group_judge_scores_each_group_in_one_call_with_the_number_it_gave_each_label(recipe_run):
    from verl_async_rm.testing.judges import JSON_DIGIT

    proc, metrics = recipe_run
    steps = {row["step"]: row["data"] for row in map(json.loads, metrics.read_text().splitlines())}
    for step in (1, 2):
        m = steps[step]
        assert m["async_rm/group/requests"] == m["async_rm/group/scored"] == TRAJECTORIES
        assert m["async_rm/group/errors"] == 0 and m["async_rm/group/judge_parse_failures"] == 0
        assert m["async_rm/group/groups_judged"] == m["async_rm/group/judge_calls"] == GROUPS
        assert m["async_rm/group/groups_partial"] == 0
    rows = [json.loads(line) for line in (proc.command.cwd / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS * TRAJECTORIES
    for row in rows:
        info = row["reward_extra_info"]
        assert info["rm_score_group"] == pytest.approx(JSON_DIGIT / SCALE)
        assert row["reward"] == pytest.approx(info["rm_score"] + 0.1 * info["rm_score_group"], abs=1e-5)