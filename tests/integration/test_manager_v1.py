"""The plugin inside verl's real v1 trainer on CPU (``PPOTrainerSync``, built as ``main_ppo`` builds it): three
GRPO steps of verl's vLLM rollout, FSDP2 actor update and weight sync, with the RM on a pool of its own.

The RM is the Llama-template tiny RM with its own tokenizer (the trajectory is re-rendered with its chat template),
mixed with the tests' rule (``2.0 * RM + 0.5 * rule``), ``on_error=raise``. One run serves the module:

- validation before training, then step 1: untouched;
- step 2: an RM replica is killed while the step's trajectories are being scored (the rollout running);
- step 3: the agent-loop workers' request timeout is cut to 0.1 ms before the step's prompts are dispatched, so every
  RM score of the step fails: verl's fit loop must stop there with the plugin's error.
"""

from __future__ import annotations

import pytest
import ray
from manager_cases import replicas_of, wait_until_busy
from trainer_cases import (
    N,
    PROMPTS,
    RM_W,
    RULE_W,
    compose,
    grpo_advantages,
    logged_metrics,
    policy_log_probs,
    rm_reference,
    rule_reference,
    running_trainer,
    trainer_overrides,
)

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster, pytest.mark.timeout(900)]

STEPS = 3


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory):
    """The run (module doc): ``(run, error raised by fit, metrics file, replicas killed)``."""
    from verl_async_rm.demo.data import demo_assets

    assets = demo_assets(tiny_models.root.parent)
    out = tmp_path_factory.mktemp("trainer_v1")
    config = compose(trainer_overrides(assets, "trainer.val_before_train=True", rm_path=tiny_models.rm_alt,
                                       steps=STEPS))
    killed = []
    with running_trainer(config, out / "metrics.jsonl") as run:
        manager = run.manager

        def kill_a_replica_mid_step():
            if run.trainer.global_steps == 2:
                victim = replicas_of(manager)[0]
                wait_until_busy(manager.rm_service)  # the step's trajectories are queued or being scored
                ray.kill(victim, no_restart=True)
                killed.append(victim)

        def cut_the_request_timeout():
            if run.trainer.global_steps == 3:
                mix = manager.async_rm_config.mix
                ray.get([w.async_rm_attach.remote(manager.rm_services, mix, 1e-4, "raise")
                         for w in manager.agent_loop_workers], timeout=60)

        run.before("sample", kill_a_replica_mid_step, target=run.trainer.replay_buffer)
        run.before("prepare_step", cut_the_request_timeout)
        error = None
        try:
            run.fit()
        except Exception as exc:  # noqa: BLE001 - what verl's fit loop raised is checked by a test
            error = exc
        yield run, error, out / "metrics.jsonl", killed


def test_it_is_verls_own_trainer_and_the_plugins_manager(trained):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from verl_async_rm.integration.agent_loop_manager import AsyncRMAgentLoopManagerV1

    run, *_ = trained
    assert type(run.trainer) is PPOTrainerSync and type(run.manager) is AsyncRMAgentLoopManagerV1
    assert [s.step for s in run.steps] == [1, 2]  # step 3 stopped before verl logged it


def test_every_reward_is_the_rms_own_template_forward_plus_the_rule(trained, tiny_models):
    run, *_ = trained
    rm, rule = rm_reference(tiny_models.rm_alt, run.config.actor_rollout_ref.model.path), rule_reference(
        run.config.actor_rollout_ref.model.path)
    for step in run.steps:
        assert len(step.keys) == PROMPTS * N
        for i in range(len(step.keys)):
            expected_rm, expected_rule = rm(step.raw_prompts[i], step.responses[i]), rule(step.responses[i])
            assert step.extra_infos[i]["rm_score"] == pytest.approx(expected_rm, abs=1e-4)
            assert step.extra_infos[i]["rule_score"] == pytest.approx(expected_rule, abs=1e-6)
            assert step.rewards[i] == pytest.approx(RM_W * expected_rm + RULE_W * expected_rule, abs=1e-4)
    assert len({round(r, 4) for s in run.steps for r in s.rewards}) > 1


def test_verls_grpo_advantages_are_computed_from_those_rewards(trained):
    run, *_ = trained
    for step in run.steps:
        expected = grpo_advantages(step.rewards, step.groups())
        assert len(step.groups()) == PROMPTS and all(len(m) == N for m in step.groups().values())
        for i, advantages in enumerate(step.advantages):
            assert advantages and all(a == pytest.approx(expected[i], abs=1e-4) for a in advantages)
        assert any(abs(a) > 0.1 for a in expected)  # the rewards of a group differ: there is something to learn


def test_the_actor_is_updated_and_the_rollout_gets_its_weights(trained):
    """Step 1's log-probs are the initial policy's (plain transformers); step 2's are not (the update changed the
    actor's weights), and verl's vLLM rollout sampled step 2 with the updated weights (verl's ``rollout_corr/kl``
    between the rollout's and the actor's log-probs stays at rounding level; without the weight sync it is ~0.1)."""
    run, *_ = trained
    initial = policy_log_probs(run.config.actor_rollout_ref.model.path)
    first, second = run.steps
    diff = [max(abs(a - b) for a, b in zip(first.old_log_probs[i], initial(first.prompts[i], first.responses[i]),
                                            strict=True)) for i in range(len(first.keys))]
    assert max(diff) < 1e-3
    moved = [max(abs(a - b) for a, b in zip(second.old_log_probs[i], initial(second.prompts[i], second.responses[i]),
                                             strict=True)) for i in range(len(second.keys))]
    assert min(moved) > 1e-3, moved
    for step in run.steps:
        assert step.metrics["actor/grad_norm"] > 0 and step.metrics["timing_s/update_weights"] > 0
        assert abs(step.metrics["rollout_corr/kl"]) < 1e-4


def test_async_rm_metrics_reach_verls_tracking_at_their_steps(trained):
    _, _, metrics_file, _ = trained
    logged = logged_metrics(metrics_file)
    for step in (1, 2):
        assert logged[(step, "async_rm/requests")] == PROMPTS * N and logged[(step, "async_rm/scored")] == PROMPTS * N
        assert logged[(step, "async_rm/errors")] == 0 and (step, "async_rm/reward_tail_s") in logged
        assert (step, "critic/score/mean") in logged and not any(k.startswith("val-async_rm/") for s, k in logged
                                                                 if s == step)
    # validation before training (val_kwargs.n=1 per prompt), logged at step 0 under its own prefix
    assert logged[(0, "val-async_rm/requests")] == logged[(0, "val-async_rm/scored")] > 0
    assert not any(key.startswith("async_rm/") for step, key in logged if step == 0)


def test_a_replica_killed_mid_step_loses_no_trajectory(trained):
    run, _, _, killed = trained
    assert len(killed) == 1
    m = run.steps[1].metrics
    assert m["async_rm/scored"] == PROMPTS * N and m["async_rm/errors"] == 0
    assert m["async_rm/requeued"] + m["async_rm/replicas_replaced_total"] >= 1
    assert all(r == r for r in run.steps[1].rewards)  # no NaN; exactness: the reward test above


def test_on_error_raise_stops_verls_fit_at_the_failed_step(trained):
    from verl_async_rm.errors import RMScoreError

    run, error, *_ = trained
    assert isinstance(error, RMScoreError), repr(error)
    assert f"{PROMPTS * N} of {PROMPTS * N} trajectories of step 3 got no RM score" in str(error)
    assert "RequestTimeoutError" in str(error)
    assert run.manager.last_metrics["async_rm/errors"] == PROMPTS * N
