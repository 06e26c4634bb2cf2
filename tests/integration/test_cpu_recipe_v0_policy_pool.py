"""``RM_PLACEMENT=policy_pool bash recipes/grpo_cpu_tiny.sh trainer.use_v1=False +async_rm.endpoint=... <judge keys>``:
verl's own ``main_ppo`` on its v0 trainer (``RayPPOTrainer``) trains two steps, with

- verl's v1 trainer hidden from every process of the run (``assets/hide_verl_v1``: importing ``verl.trainer.ppo.v1``
  raises, as on verl's ``neo`` branch): the plugin imports and scores without it;
- its main RM a logits judge served by vLLM's own OpenAI-compatible server (its CPU build, on 127.0.0.1:
  ``python -m verl_async_rm.testing.vllm_server`` runs the recipe while it serves the tiny ``digit`` judge);
- an extra RM, ``local``, the same judge loaded by the plugin on the policy's (logical) GPU (weight 0: the reward is
  the remote judge's), so that every trajectory's remote score is checked against the local readout of the same
  checkpoint (verl's ``trainer.rollout_data_dir`` writes each trajectory's ``reward_extra_info``). verl's v0 fit loop
  gives the manager no phase hook: the manager wakes the local RM as each rollout starts and puts it to sleep as a
  training batch returns, before verl updates the actor.

With the main RM remote no reward pool is placed (``enable_resource_pool=False``). v0 with the RM on its own pool:
``test_cpu_recipe_v0.py``; v1 on the policy's GPUs: ``test_manager_v1.py``. One run holds the placement and the
remote RM because each run of verl's trainer costs this 2-core machine minutes."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import TEST_ASSETS, require_vllm
from program_runs import Command, logged_steps, recipe_command

pytestmark = pytest.mark.integration

STEPS, TRAJECTORIES = 2, 8 * 4
HIDE_V1 = TEST_ASSETS / "hide_verl_v1"
PROMPT = "Question: {{ prompt }} Answer: {{ response }}"


def program_command(request) -> Command:
    from verl_async_rm.testing.judges import LOGITS_TOKENS

    judge = request.getfixturevalue("tiny_judges").digit
    path = os.pathsep.join(p for p in (str(HIDE_V1), os.environ.get("PYTHONPATH", "")) if p)
    recipe = recipe_command(
        request, "cpu_recipe_v0_pp", f"trainer.total_training_steps={STEPS}", "trainer.use_v1=False",
        "+async_rm.endpoint={endpoint}", "+async_rm.reward_kind=judge", "+async_rm.judge_readout=logits",
        f"+async_rm.judge_tokens=[{','.join(repr(t) for t in LOGITS_TOKENS)}]", f"+async_rm.judge_prompt='{PROMPT}'",
        f"+async_rm.models.local.model_path={judge}", "+async_rm.models.local.weight=0",
        "+trainer.rollout_data_dir=rollouts", env={"RM_PLACEMENT": "policy_pool", "RM_PATH": str(judge),
                                                   "PYTHONPATH": path})
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


def test_v0_trains_two_steps_with_a_judge_served_by_vllms_server_and_v1_never_imported(run):
    proc, steps, _ = run
    assert "hidden by tests/integration/assets/hide_verl_v1" not in proc.stdout + proc.stderr
    assert set(steps) == {0, 1, 2}  # the validation before training, then the two steps
    for step in (1, 2):
        m = steps[step]
        assert m["timing_s/async_rm/requests"] == m["timing_s/async_rm/scored"] == TRAJECTORIES
        assert m["timing_s/async_rm/errors"] == 0
        assert m["timing_s/async_rm/endpoint_requests"] >= TRAJECTORIES
        assert m["timing_s/async_rm/endpoint_tokens_in"] > 0
        assert m["timing_s/async_rm/local/scored"] == TRAJECTORIES and m["timing_s/async_rm/local/errors"] == 0
        assert m["timing_s/async_rm/local/batches"] >= 1
        assert m["actor/grad_norm"] > 0 and m["timing_s/update_weights"] > 0
    assert steps[0]["val-async_rm/scored"] == steps[0]["val-async_rm/requests"] > 0
    assert steps[0]["val-async_rm/errors"] == 0


def test_the_local_rm_on_the_policys_gpu_sleeps_and_wakes_each_v0_step(run):
    _, steps, _ = run
    for step in (1, 2):
        m = steps[step]
        assert m["timing_s/async_rm/local/sleeps"] == 1 and m["timing_s/async_rm/local/sleep_bytes"] > 0
        assert m["timing_s/async_rm/local/wakes"] == step - 1  # step 1 starts awake (loaded); step 2 wakes from 1's
    # step 2: asleep from step 1's sleep through step 1's update, awake through its own rollout
    assert 0 < steps[2]["timing_s/async_rm/local/rm_awake_share"] < 1
    assert steps[2]["timing_s/async_rm/local/wake_bytes"] > 0


def test_every_reward_is_the_local_readout_of_the_same_judge(run):
    _, _, rows = run
    assert len(rows) == STEPS * TRAJECTORIES
    for row in rows:
        assert row["rm_score"] == pytest.approx(row["rm_score_local"], abs=1e-3), row["input"]
        assert row["score"] == pytest.approx(row["rm_score"], abs=1e-5)  # weight 0 for the local one, no rule
    assert len({round(row["rm_score"], 4) for row in rows}) > 1  # not one constant
