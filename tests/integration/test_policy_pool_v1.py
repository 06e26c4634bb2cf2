"""The RM on the policy's GPUs (``reward.reward_model.enable_resource_pool=False``) inside verl's real v1 trainer on
CPU: its replica goes in the bundle of verl's own actor/rollout pool (``global_pool``, one logical GPU), beside
verl's real FSDP2 actor and vLLM rollout; it scores every trajectory as it finishes, sleeps after the step's
sampling (verl's ``on_sample_end``, wrapped by the plugin), stays asleep through verl's real ``update_actor``, and wakes
after verl's weight sync (``on_step_end``). Three steps; during step 2's update the asleep replica is killed, and the
wake replaces it in the same bundle before step 3's rollout.

The RM is the Llama-template tiny RM (re-rendered with its own chat template) mixed with the tests' rule.
"""

from __future__ import annotations

import pytest
import ray
from manager_cases import replicas_of
from trainer_cases import N, PROMPTS, RM_W, RULE_W, compose, rm_reference, rule_reference, running_trainer, \
    trainer_overrides

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster, pytest.mark.timeout(900)]

STEPS = 3


def _describe(manager) -> list[dict]:
    return ray.get(manager.rm_service.describe.remote(), timeout=60)


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
def colocated(tiny_models, tmp_path_factory):
    """The run: ``(run, seen)``; ``seen[step]`` holds what the test looked at before verl's update of that step."""
    from verl_async_rm.demo.data import demo_assets

    assets = demo_assets(tiny_models.root.parent)
    out = tmp_path_factory.mktemp("policy_pool_v1")
    config = compose(trainer_overrides(assets, rm_path=tiny_models.rm_alt, steps=STEPS, rm_gpus=0))
    seen: dict[int, dict] = {}
    with running_trainer(config, out / "metrics.jsonl") as run:
        manager = run.manager
        pool = run.trainer.resource_pool_manager.resource_pool_dict["global_pool"]
        seen["pool"] = {"pgs": [pg.id.hex() for pg in pool.pgs], "replicas": _describe(manager),
                        "bundles": [len(pg.bundle_specs) for pg in pool.pgs]}
        seen["pool"]["verl"] = _placements(_verls_actors(run.trainer))
        seen["pool"]["rm"] = _placements({"rm": replicas_of(manager)[0]})

        def before_update():
            step = run.trainer.global_steps
            seen[step] = {"replicas": _describe(manager)}
            if step == 2:
                victim = replicas_of(manager)[0]
                ray.kill(victim, no_restart=True)
                seen[step]["killed"] = True

        run.before("_update_actor", before_update)
        run.fit()
        seen["end"] = {"replicas": _describe(manager), "rm": _placements({"rm": replicas_of(manager)[0]})}
        yield run, seen


def test_the_replica_is_in_the_bundle_of_verls_actor_and_rollout(colocated):
    _, seen = colocated
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


def test_it_sleeps_through_every_real_update_and_wakes_for_the_next_rollout(colocated):
    run, seen = colocated
    for step in range(1, STEPS + 1):
        assert all(r.get("asleep") for r in seen[step]["replicas"]), seen[step]
        m = run.steps[step - 1].metrics
        assert m["async_rm/sleeps"] == 1 and m["async_rm/sleep_bytes"] > 0 and 0 < m["async_rm/rm_awake_share"] < 1
    for before, after in zip(run.steps, run.steps[1:]):
        assert after.metrics["async_rm/wakes"] == 1
    assert not any(r.get("asleep") for r in seen["end"]["replicas"])  # awake for a next rollout


def test_a_replica_killed_asleep_is_replaced_in_its_bundle_at_the_wake(colocated):
    run, seen = colocated
    assert seen[2].get("killed")
    third = run.steps[2].metrics
    assert third["async_rm/scored"] == PROMPTS * N and third["async_rm/errors"] == 0
    replica = seen["end"]["replicas"][0]
    assert "stand_in" in replica["actor_name"] and seen["end"]["rm"]["rm"] == seen["pool"]["rm"]["rm"]


def test_every_trajectory_of_three_steps_is_scored_exactly(colocated, tiny_models):
    run, _ = colocated
    policy = run.config.actor_rollout_ref.model.path
    rm, rule = rm_reference(tiny_models.rm_alt, policy), rule_reference(policy)
    assert [s.step for s in run.steps] == [1, 2, 3]
    for step in run.steps:
        assert len(step.keys) == PROMPTS * N and step.metrics["async_rm/scored"] == PROMPTS * N
        for i in range(len(step.keys)):
            expected = RM_W * rm(step.raw_prompts[i], step.responses[i]) + RULE_W * rule(step.responses[i])
            assert step.rewards[i] == pytest.approx(expected, abs=1e-4)
