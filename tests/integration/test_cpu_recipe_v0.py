"""``bash recipes/grpo_cpu_tiny.sh trainer.use_v1=False`` on verl's v0 trainer (``RayPPOTrainer``) for two steps, as
a user runs it (verl's own ``python -m verl.trainer.main_ppo``: its own Ray cluster, the demo's tiny models and data,
verl's vLLM rollout, FSDP2 actor with the reference model, the RM on its own pool), with

- verl's v1 trainer hidden from every process of the run (``assets/hide_verl_v1``: importing ``verl.trainer.ppo.v1``
  raises, as on verl's ``neo`` branch): the plugin imports and scores without it, the actor trains, the plugin's
  metrics reach verl's tracker (a training step's as ``timing_s/async_rm/*``, the validation pass's as
  ``val-async_rm/*``);
- beside the recipe's RM, two extra RMs, each a group judge (``reward_kind=group_judge``: one call per GRPO group of
  4) of the tiny ``json`` judge (``testing/judges.py``) with structured output: ``group`` on a local vLLM engine,
  ``served`` at vLLM's own OpenAI-compatible server (its CPU build, on 127.0.0.1: ``python -m
  verl_async_rm.testing.vllm_server`` runs the recipe while it serves the judge; ``response_format`` with the JSON
  schema). The judge gives every label :data:`~verl_async_rm.testing.judges.JSON_DIGIT`, so every trajectory's
  ``rm_score_group`` and ``rm_score_served`` are known (verl's ``trainer.rollout_data_dir`` writes each trajectory's
  ``reward_extra_info``);
- a third extra RM, ``pair``: the same judge as a pairwise judge (``reward_kind=pairwise_judge``, writing its
  ``{"winner": ...}`` under structured output) on a local vLLM engine, each of a group's 6 pairs asked in both
  orders. Constrained, the tiny judge names the same position every time, so both orders cancel out: every
  trajectory's ``rm_score_pair`` is 0.5 (validation with two responses per prompt, so its groups have pairs).

The v1 trainer runs ``main_ppo`` in ``test_demo.py`` (the plugin on its own pool) and in-process in
``test_manager_v1.py`` (on the policy's GPUs); v0 on the policy's GPUs with a remote judge:
``test_cpu_recipe_v0_policy_pool.py``. One run holds v0, the hidden v1 and the group judge because each run of verl's
trainer costs this 2-core machine minutes."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import TEST_ASSETS, require_vllm
from program_runs import Command, logged_steps, recipe_command

pytestmark = pytest.mark.integration

STEPS, TRAJECTORIES, GROUPS = 2, 8 * 4, 8  # the recipe's 8 prompts x 4 responses
HIDE_V1 = TEST_ASSETS / "hide_verl_v1"
SCALE, GROUP_W, SERVED_W, PAIR_W = 10, 0.1, 0.2, 0.3


def program_command(request) -> Command:
    judge = request.getfixturevalue("tiny_judges").json
    keys = (("model_path", judge), ("reward_kind", "group_judge"), ("judge_max_tokens", 48), ("judge_scale", SCALE))
    group = [f"+async_rm.models.group.{key}={value}" for key, value in (*keys, ("weight", GROUP_W))]
    served = [f"+async_rm.models.served.{key}={value}" for key, value in
              (*keys, ("weight", SERVED_W), ("endpoint", "{endpoint}"))]
    pair = [f"+async_rm.models.pair.{key}={value}" for key, value in (
        ("model_path", judge), ("reward_kind", "pairwise_judge"), ("judge_readout", "generate"),
        ("judge_max_tokens", 16), ("weight", PAIR_W))]
    path = os.pathsep.join(p for p in (str(HIDE_V1), os.environ.get("PYTHONPATH", "")) if p)
    recipe = recipe_command(request, "cpu_recipe_v0", f"trainer.total_training_steps={STEPS}", "trainer.use_v1=False",
                            *group, *served, *pair, "actor_rollout_ref.rollout.val_kwargs.n=2",
                            "+trainer.rollout_data_dir=rollouts", env={"PYTHONPATH": path})
    server = [sys.executable, "-m", "verl_async_rm.testing.vllm_server", "--model", str(judge), "--name", "judge",
              "--log-dir", str(recipe.cwd), "--"]
    return Command([*server, *recipe.argv], recipe.cwd, recipe.env, recipe.timeout_s)


@pytest.fixture(scope="module")
def run(request, program_runs):
    require_vllm()
    proc = program_runs.finish(__name__, lambda: program_command(request))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = [json.loads(line) for step in range(1, STEPS + 1)
            for line in (proc.command.cwd / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
    return proc, logged_steps(proc.command.cwd / "metrics.jsonl"), rows


def test_v0_trains_two_steps_with_every_trajectory_scored_and_v1_never_imported(run):
    proc, steps, _ = run
    assert "hidden by tests/integration/assets/hide_verl_v1" not in proc.stdout + proc.stderr
    assert set(steps) == {0, 1, 2}  # the validation before training, then the two steps
    for step in (1, 2):
        m = steps[step]
        assert m["timing_s/async_rm/requests"] == m["timing_s/async_rm/scored"] == TRAJECTORIES
        assert m["timing_s/async_rm/errors"] == 0 and m["timing_s/async_rm/batches"] >= 1
        assert m["actor/grad_norm"] > 0 and "actor/kl_loss" in m and m["timing_s/ref"] > 0
        assert m["timing_s/update_weights"] > 0
    assert steps[2]["actor/kl_loss"] > 0  # the actor moved away from the reference model after step 1
    assert steps[0]["val-async_rm/scored"] == steps[0]["val-async_rm/requests"] > 0
    assert steps[0]["val-async_rm/errors"] == 0


@pytest.mark.parametrize("name", ["group", "served"])
def test_a_group_judge_local_or_served_scores_each_group_in_one_call_with_the_number_it_gave_each_label(run, name):
    from verl_async_rm.testing.judges import JSON_DIGIT

    _, steps, rows = run
    for step in (1, 2):
        m = {key.removeprefix(f"timing_s/async_rm/{name}/"): value for key, value in steps[step].items()}
        assert m["requests"] == m["scored"] == TRAJECTORIES
        assert m["errors"] == 0 and m["judge_parse_failures"] == 0 and m["groups_partial"] == 0
        assert m["groups_judged"] == m["judge_calls"] == GROUPS
        if name == "served":
            assert m["endpoint_requests"] == GROUPS and m["endpoint_tokens_out"] > 0
    assert len(rows) == STEPS * TRAJECTORIES
    for row in rows:
        assert row[f"rm_score_{name}"] == pytest.approx(JSON_DIGIT / SCALE)
        assert row["score"] == pytest.approx(
            row["rm_score"] + GROUP_W * row["rm_score_group"] + SERVED_W * row["rm_score_served"]
            + PAIR_W * row["rm_score_pair"], abs=1e-5)


def test_a_pairwise_judge_asks_each_pair_in_both_orders_and_a_judge_that_names_one_position_gains_nothing(run):
    _, steps, rows = run
    for step in (1, 2):
        m = {key.removeprefix("timing_s/async_rm/pair/"): value for key, value in steps[step].items()}
        assert m["requests"] == m["scored"] == TRAJECTORIES and m["errors"] == 0
        assert m["groups_judged"] == GROUPS and m["comparisons"] == GROUPS * 12  # 6 pairs of 4, both orders
        assert m["comparisons_per_trajectory"] == 3 and m["comparisons_failed"] == 0
        # the tiny judge names the same letter whatever it reads: every pair's two orders disagree, none is a tie
        assert m["position_flip_rate"] == 1.0 and m["pairwise_ties"] == 0 and m["judge_calls"] == GROUPS * 12
    assert {row["rm_score_pair"] for row in rows} == {0.5}
