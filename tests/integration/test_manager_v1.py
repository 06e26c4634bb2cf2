"""The plugin inside verl's real v1 trainer on CPU (``PPOTrainerSync``, built as ``main_ppo`` builds it): GRPO steps
of verl's vLLM rollout, FSDP2 actor update and weight sync, with the RM on the policy's GPUs
(``reward.reward_model.enable_resource_pool=False``): its replica goes in the bundle of verl's own actor/rollout pool
(``global_pool``, one logical GPU), scores every trajectory as it finishes, sleeps after the step's sampling (verl's
``on_sample_end``, wrapped by the plugin), stays asleep through verl's real ``update_actor``, and wakes after verl's
weight sync (``on_step_end``).

The RM is the Llama-template tiny RM with its own tokenizer (the trajectory is re-rendered with its chat template),
mixed with the tests' rule (``2.0 * RM + 0.5 * rule``), ``on_error=raise``. One run of five steps serves the module
(one trainer start is ~95 CPU-s of this machine, a step ~1 s):

- validation before training, then step 1: untouched;
- step 2: the replica is killed while the step's trajectories are being scored (the rollout running);
- step 3: during verl's update the asleep replica is killed; the wake replaces it in the same bundle;
- step 4: scored by that replacement;
- step 5: the agent-loop workers' request timeout is cut to 0.1 ms before the step's prompts are dispatched, so every
  RM score of the step fails: verl's fit loop must stop there with the plugin's error.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray
from manager_cases import replicas_of
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

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

STEPS = 5
TRAINED = [1, 2, 3, 4]  # the steps verl logged: step 5 stops at the plugin's error


def _describe(manager) -> list[dict]:
    return ray.get(manager.rm_service.describe.remote(), timeout=60)


def _the_replica(manager) -> tuple:
    """The RM's one replica now (a replacement once loaded) and its actor name."""
    replica = replicas_of(manager)[0]
    return replica, _describe(manager)[0]["actor_name"]


def _placements(actors: dict) -> dict[str, str | None]:
    """``name -> placement group id`` of each actor, asked inside the actor (``__ray_call__``)."""

    def where(_self):
        return ray.get_runtime_context().get_placement_group_id()

    return dict(zip(actors, ray.get([a.__ray_call__.remote(where) for a in actors.values()], timeout=60),
                    strict=True))


def _verls_actors(trainer) -> dict:
    """verl's actor worker(s) and its vLLM rollout replica's workers (the engine; its HTTP server is a CPU actor
    outside the pool)."""
    actors = {f"actor_worker_{i}": w for i, w in enumerate(trainer.actor_rollout_wg.workers)}
    for r, replica in enumerate(trainer.llm_server_manager.get_replicas()):
        actors.update({f"rollout_{r}_worker_{i}": a for i, a in enumerate(replica.workers)})
    return actors


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory):
    """The run (module doc): ``(run, error raised by fit, metrics file, seen)``; ``seen[step]`` holds what the test
    looked at before verl's update of that step, ``seen["killed"]`` the replicas killed, ``seen["next"]`` the
    replicas as step 5's rollout starts."""
    from verl_async_rm.demo.data import demo_assets

    assets = demo_assets(tiny_models.root.parent)
    out = tmp_path_factory.mktemp("trainer_v1")
    config = compose(trainer_overrides(assets, "trainer.val_before_train=True", rm_path=tiny_models.rm_alt,
                                       steps=STEPS, rm_gpus=0))
    seen: dict = {"killed": {}}
    with running_trainer(config, out / "metrics.jsonl") as run:
        manager = run.manager
        pool = run.trainer.resource_pool_manager.resource_pool_dict["global_pool"]
        seen["pool"] = {"pgs": [pg.id.hex() for pg in pool.pgs], "replicas": _describe(manager),
                        "bundles": [len(pg.bundle_specs) for pg in pool.pgs]}
        seen["pool"]["verl"] = _placements(_verls_actors(run.trainer))
        seen["pool"]["rm"] = _placements({"rm": replicas_of(manager)[0]})

        def kill_the_replica_once_it_holds_work():
            """From step 2's dispatch: poll the service and kill its replica the moment a request of the step is
            queued or being scored (the batcher holds a request up to ``max_wait_ms``), within a bound."""
            victim, name = _the_replica(manager)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                stats = ray.get(manager.rm_service.stats.remote(), timeout=30)
                if stats["in_flight_requests"] or stats["queue_len"]:
                    ray.kill(victim, no_restart=True)
                    seen["killed"]["mid_step"] = name
                    return
                time.sleep(0.002)

        watcher = threading.Thread(target=kill_the_replica_once_it_holds_work, daemon=True)

        def before_update():
            step = run.trainer.global_steps
            if step == 2:
                watcher.join(timeout=150)
            seen[step] = {"replicas": _describe(manager)}
            if step == 3:
                victim, name = _the_replica(manager)
                ray.kill(victim, no_restart=True)
                seen["killed"]["asleep"] = name

        def before_dispatch():
            if run.trainer.global_steps == 2:
                watcher.start()
            if run.trainer.global_steps == 5:
                seen["next"] = {"replicas": _describe(manager), "rm": _placements({"rm": replicas_of(manager)[0]})}
                mix = manager.async_rm_config.mix
                ray.get([w.async_rm_attach.remote(manager.rm_services, mix, 1e-4, "raise")
                         for w in manager.agent_loop_workers], timeout=60)

        run.before("_update_actor", before_update)
        run.before("prepare_step", before_dispatch)
        error = None
        try:
            run.fit()
        except Exception as exc:  # noqa: BLE001 - what verl's fit loop raised is checked by a test
            error = exc
        yield run, error, out / "metrics.jsonl", seen


def test_it_is_verls_own_trainer_and_the_plugins_manager(trained):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from verl_async_rm.integration.v1 import AsyncRMAgentLoopManagerV1

    run, *_ = trained
    assert type(run.trainer) is PPOTrainerSync and type(run.manager) is AsyncRMAgentLoopManagerV1
    assert [s.step for s in run.steps] == TRAINED  # step 5 stopped before verl logged it


def test_every_reward_is_the_rms_own_template_forward_plus_the_rule(trained, tiny_models):
    run, *_ = trained
    rm, rule = rm_reference(tiny_models.rm_alt, run.config.actor_rollout_ref.model.path), rule_reference(
        run.config.actor_rollout_ref.model.path)
    for step in run.steps:
        assert len(step.keys) == PROMPTS * N and step.metrics["async_rm/scored"] == PROMPTS * N
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
    first, second = run.steps[:2]
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
    for step in TRAINED:
        assert logged[(step, "async_rm/requests")] == PROMPTS * N and logged[(step, "async_rm/scored")] == PROMPTS * N
        assert logged[(step, "async_rm/errors")] == 0 and (step, "async_rm/reward_tail_s") in logged
        assert (step, "critic/score/mean") in logged and not any(k.startswith("val-async_rm/") for s, k in logged
                                                                 if s == step)
    # validation before training (val_kwargs.n=1 per prompt), logged at step 0 under its own prefix
    assert logged[(0, "val-async_rm/requests")] == logged[(0, "val-async_rm/scored")] > 0
    assert not any(key.startswith("async_rm/") for step, key in logged if step == 0)


def test_the_replica_is_in_the_bundle_of_verls_actor_and_rollout(trained):
    *_, seen = trained
    pool = seen["pool"]
    assert len(pool["replicas"]) == 1  # one per GPU of trainer.n_gpus_per_node x nnodes
    info = pool["replicas"][0]
    assert info["placement"] == "policy_pool" and info["placement_group_id"] in pool["pgs"]
    # verl's actor worker and its vLLM rollout's worker run in that group of one bundle (one logical GPU), and so
    # does the replica (on CPU it takes a share of the bundle's CPUs only: trainer.device=cpu)
    assert pool["bundles"] == [1]
    assert any(name.startswith("actor_worker") for name in pool["verl"]) and any(
        name.startswith("rollout_") for name in pool["verl"]), pool["verl"]
    assert set(pool["verl"].values()) == {pool["pgs"][0]} == {pool["rm"]["rm"]}, pool


def test_it_sleeps_through_every_real_update_and_wakes_for_the_next_rollout(trained):
    run, *_, seen = trained
    for step in TRAINED:
        assert all(r.get("asleep") for r in seen[step]["replicas"]), seen[step]
        m = run.steps[step - 1].metrics
        assert m["async_rm/sleeps"] == 1 and m["async_rm/sleep_bytes"] > 0 and 0 < m["async_rm/rm_awake_share"] < 1
    for after in run.steps[1:]:
        assert after.metrics["async_rm/wakes"] == 1
    assert not any(r.get("asleep") for r in seen["next"]["replicas"])  # awake for step 5's rollout


def test_a_replica_killed_asleep_is_replaced_in_its_bundle_at_the_wake(trained):
    run, *_, seen = trained
    killed = seen["killed"]
    assert "replacement" in killed["asleep"]  # step 2's replacement
    fourth = run.steps[3].metrics
    assert fourth["async_rm/scored"] == PROMPTS * N and fourth["async_rm/errors"] == 0
    assert fourth["async_rm/replicas_replaced_total"] == 2  # step 2's and this one
    replica = seen["next"]["replicas"][0]
    assert "replacement" in replica["actor_name"] and replica["actor_name"] not in killed.values()
    assert seen["next"]["rm"]["rm"] == seen["pool"]["rm"]["rm"]


def test_a_replica_killed_mid_step_loses_no_trajectory(trained):
    run, *_, seen = trained
    killed = seen["killed"]["mid_step"]
    m = run.steps[1].metrics
    assert m["async_rm/scored"] == PROMPTS * N and m["async_rm/errors"] == 0
    assert all(r == r for r in run.steps[1].rewards)  # no NaN; exactness: the reward test above
    # its batch was re-queued and scored by a replica started in the step, in its bundle
    assert m["async_rm/requeued"] >= 1 and m["async_rm/replicas_replaced_total"] == 1, m
    assert seen[2]["replicas"][0]["actor_name"] != killed, seen[2]


def test_on_error_raise_stops_verls_fit_at_the_failed_step(trained):
    from verl_async_rm.errors import RMScoreError

    run, error, *_ = trained
    assert isinstance(error, RMScoreError), repr(error)
    assert f"{PROMPTS * N} of {PROMPTS * N} trajectories of step 5 got no RM score" in str(error)
    assert "RequestTimeoutError" in str(error)
    assert run.manager.last_metrics["async_rm/errors"] == PROMPTS * N
