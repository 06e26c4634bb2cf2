"""``RM_PLACEMENT=policy_pool bash recipes/grpo_cpu_tiny.sh +async_rm.endpoint=... <judge keys>``: verl's own
``main_ppo`` (v1 sync trainer) trains two steps with its main RM a logits judge served by vLLM's own OpenAI-compatible
server (its CPU build, on 127.0.0.1: ``python -m verl_async_rm.testing.vllm_server`` runs the recipe while it serves the
tiny ``digit`` judge). An extra RM, ``local``, is the same judge loaded by the plugin on the policy's (logical) GPU
(weight 0: the reward is the remote judge's), so every trajectory's remote score is checked against the local readout
of the same checkpoint; the demo's replay buffer (``demo/sampler.py``) records each trajectory's ``reward_extra_info``.
This is also the CI run of the RM on the policy's GPUs on the v1 trainer (the v0 one:
``test_cpu_recipe_v0_policy_pool.py``): the local RM sleeps after each step's sampling and wakes at its end. With the
main RM remote no reward pool is placed (``enable_resource_pool=False``)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import require_vllm
from program_runs import Command, logged_steps, recipe_command

pytestmark = pytest.mark.integration

STEPS, TRAJECTORIES = 2, 8 * 4
PROMPT = "Question: {{ prompt }} Answer: {{ response }}"


def program_command(request) -> Command:
    from verl_async_rm.demo.sampler import TimedReplayBuffer
    from verl_async_rm.testing.judges import LOGITS_TOKENS
    from verl_async_rm.testing.replay_buffer import short_poll_overrides

    judge = request.getfixturevalue("tiny_judges").digit
    recipe = recipe_command(
        request, "cpu_recipe_pp_remote", f"trainer.total_training_steps={STEPS}",
        "+async_rm.endpoint={endpoint}", "+async_rm.reward_kind=judge", "+async_rm.judge_readout=logits",
        f"+async_rm.judge_tokens=[{','.join(repr(t) for t in LOGITS_TOKENS)}]", f"+async_rm.judge_prompt='{PROMPT}'",
        f"+async_rm.models.local.model_path={judge}", "+async_rm.models.local.weight=0",
        *short_poll_overrides("sync", cls=TimedReplayBuffer), "+trainer.v1.sampler.sampler_kwargs.record_path="
        "trajectories.jsonl", env={"RM_PLACEMENT": "policy_pool", "RM_PATH": str(judge)})
    server = [sys.executable, "-m", "verl_async_rm.testing.vllm_server", "--model", str(judge), "--name", "judge",
              "--log-dir", str(recipe.cwd), "--"]
    return Command([*server, *recipe.argv], recipe.cwd, recipe.env, recipe.timeout_s)


@pytest.fixture(scope="module")
def run(request, program_runs):
    require_vllm()
    proc = program_runs.finish(__name__, lambda: program_command(request))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = [json.loads(line) for line in (proc.command.cwd / "trajectories.jsonl").read_text().splitlines()]
    return logged_steps(proc.command.cwd / "metrics.jsonl"), rows


def test_the_recipe_trains_with_a_judge_served_by_vllms_server(run):
    steps, _ = run
    assert set(steps) == {0, 1, 2}
    for step in (1, 2):
        m = steps[step]
        assert m["async_rm/requests"] == m["async_rm/scored"] == TRAJECTORIES and m["async_rm/errors"] == 0
        assert m["async_rm/endpoint_requests"] >= TRAJECTORIES and m["async_rm/endpoint_tokens_in"] > 0
        assert m["async_rm/local/scored"] == TRAJECTORIES and m["async_rm/local/errors"] == 0
        assert m["actor/grad_norm"] > 0 and m["timing_s/update_weights"] > 0
    assert steps[0]["val-async_rm/scored"] == steps[0]["val-async_rm/requests"] > 0


def test_the_local_rm_on_the_policys_gpu_sleeps_after_each_sampling_and_wakes_for_the_next_rollout(run):
    steps, _ = run
    for step in (1, 2):
        m = steps[step]
        assert m["async_rm/local/sleeps"] == 1 and m["async_rm/local/sleep_bytes"] > 0
        assert m["async_rm/local/wakes"] == step - 1  # step 1 starts awake (loaded); its end's wake counts in step 2
    assert 0 < steps[2]["async_rm/local/rm_awake_share"] < 1 and steps[2]["async_rm/local/wake_bytes"] > 0


def test_every_reward_is_the_local_readout_of_the_same_judge(run):
    _, rows = run
    assert len(rows) == STEPS * TRAJECTORIES
    for row in rows:
        info = row["reward_extra_info"]
        assert info["rm_score"] == pytest.approx(info["rm_score_local"], abs=1e-3), row["key"]
        assert row["reward"] == pytest.approx(info["rm_score"], abs=1e-6)  # weight 0 for the local one, no rule
    assert len({round(r["reward_extra_info"]["rm_score"], 4) for r in rows}) > 1  # not one constant
