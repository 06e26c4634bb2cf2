"""The RM on the policy's GPUs (``reward.reward_model.enable_resource_pool=False``) through verl's v1 fit loop.

The policy pool is verl's own ``RayResourcePool`` named as verl's trainer names it (``global_pool``), holding a verl
``Worker`` per bundle in the actor's place; on this CPU machine its bundles are CPU-only (``use_gpu=False``) and
hold 2 processes each instead of verl's 3 (``ResourcePoolManager.max_colocate_count``), to leave the session's 8
CPUs to the other actors. The loop is :class:`verl_async_rm.testing.V1FitLoop`, whose ``on_sample_end`` /
``on_step_end`` the plugin wraps as it wraps a real trainer's: the RM sleeps after each step's sampling and wakes
after the step. The generation is the synthetic server of the other manager tests (no rollout to sleep).
"""

from __future__ import annotations

import time

import pytest
import ray
from manager_cases import direct_scores, RM_W, RULE_W, replicas_of, running_manager

pytestmark = pytest.mark.integration

N = 2  # rollout.n
POLICY_GPUS = 2


@pytest.fixture(scope="module")
def policy_pool(ray_local):
    from verl.single_controller.base import Worker
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool(process_on_nodes=[POLICY_GPUS], use_gpu=False, max_colocate_count=2,
                           name_prefix="global_pool")
    pgs = pool.get_placement_groups()
    actor_cls = type("PolicyStandIn", (Worker,), {"ping": lambda self: True})
    actors = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(actor_cls)),
                            name_prefix="policy_stand_in_", device_name="cpu")
    ray.get([w.ping.remote() for w in actors.workers], timeout=120)
    yield pgs, actors
    for worker in actors.workers:
        ray.kill(worker)
    for pg in pgs:
        ray.util.remove_placement_group(pg)


@pytest.fixture(scope="module")
def colocated(ray_local, tiny_models, policy_pool):
    from verl_async_rm.testing.v1 import V1FitLoop

    extra = ("reward.reward_model.enable_resource_pool=False", f"trainer.n_gpus_per_node={POLICY_GPUS}",
             "trainer.nnodes=1")
    with running_manager(ray_local, tiny_models, "v1", *extra) as (manager, config):
        yield V1FitLoop(config, manager), manager


def _check_exact(batch, tiny_models):
    for i, (direct, rule) in enumerate(direct_scores(batch, tiny_models.rm, tiny_models.policy)):
        info = batch.reward_extra_info(i)
        assert info["rm_score"] == pytest.approx(direct, abs=1e-4)
        assert batch.reward(i) == pytest.approx(RM_W * direct + RULE_W * rule, abs=1e-4)


def _placement_groups(infos) -> list[str]:
    return [info["placement_group_id"] for info in infos]


def test_replicas_are_placed_in_the_policy_pools_bundles(colocated, policy_pool):
    loop, manager = colocated
    pgs, _ = policy_pool
    infos = ray.get(manager.rm_service.describe.remote(), timeout=60)
    assert len(infos) == POLICY_GPUS  # one replica per GPU of trainer.n_gpus_per_node x nnodes
    assert all(info["placement"] == "policy_pool" and info["asleep"] is False for info in infos)
    assert set(_placement_groups(infos)) == {pg.id.hex() for pg in pgs}


def test_three_steps_sleep_and_wake_and_score_every_trajectory_exactly(colocated, tiny_models):
    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = colocated
    batches = [loop.train_step(prompt_batch([f"question {step} a", f"question {step} b"])) for step in range(3)]
    for batch in batches:
        assert len(batch.keys) == 2 * N
        _check_exact(batch, tiny_models)  # the same before the first cycle and after each one
        metrics = batch.metrics
        assert metrics["async_rm/scored"] == 2 * N and metrics["async_rm/errors"] == 0
        assert metrics["async_rm/sleeps"] == 1  # after the step's sampling
        assert metrics["async_rm/sleep_bytes"] > 0 and metrics["async_rm/rm_asleep_s"] > 0
        assert 0 < metrics["async_rm/rm_awake_share"] < 1
    # each wake (after a step) counts in the next step, before its rollout; it moves back what the sleep moved
    for before, after in zip(batches, batches[1:]):
        assert after.metrics["async_rm/wakes"] == 1
        assert after.metrics["async_rm/wake_bytes"] == before.metrics["async_rm/sleep_bytes"]
    infos = ray.get(manager.rm_service.describe.remote(), timeout=60)
    assert not any(info["asleep"] for info in infos)  # awake for the next rollout


def test_a_trajectory_that_arrives_while_asleep_waits_for_the_wake(colocated, tiny_models):
    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = colocated
    manager.async_rm_sleep()
    assert all(info["asleep"] for info in ray.get(manager.rm_service.describe.remote(), timeout=60))
    loop.global_steps += 1
    loop.dispatch(prompt_batch(["asked while the RM sleeps"]))
    deadline = time.monotonic() + 120
    while ray.get(manager.rm_service.stats.remote(), timeout=30)["queue_len"] < N:
        assert time.monotonic() < deadline, "the trajectories never reached the RM service"
        time.sleep(0.05)
    time.sleep(0.5)  # longer than max_wait_ms: a batch would have formed by now if the RM were awake
    stats = ray.get(manager.rm_service.stats.remote(), timeout=30)
    assert stats["queue_len"] == N and stats["in_flight_requests"] == 0
    manager.async_rm_wake()
    loop.global_steps -= 1
    batch = loop.train_step(None, batch_size=1)
    assert len(batch.keys) == N and batch.metrics["async_rm/scored"] == N and batch.metrics["async_rm/errors"] == 0
    _check_exact(batch, tiny_models)


def test_a_replica_killed_while_asleep_is_replaced_at_the_wake(colocated, tiny_models, policy_pool):
    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = colocated
    pgs, _ = policy_pool
    manager.async_rm_sleep()
    victim = replicas_of(manager)[0]
    ray.kill(victim, no_restart=True)
    manager.async_rm_wake()
    batch = loop.train_step(prompt_batch(["after a replica died asleep", "another"]))
    assert batch.metrics["async_rm/scored"] == 2 * N and batch.metrics["async_rm/errors"] == 0
    _check_exact(batch, tiny_models)
    replicas_of(manager)  # the stand-in loads while the other replica scores: wait (bounded) until it answers
    infos = ray.get(manager.rm_service.describe.remote(), timeout=60)
    assert batch.metrics["async_rm/replicas_replaced_total"] + ray.get(
        manager.rm_service.stats.remote(), timeout=30)["replicas_replaced_total"] >= 1
    assert sum("stand_in" in info["actor_name"] for info in infos) == 1  # the stand-in is in the victim's bundle
    assert set(_placement_groups(infos)) == {pg.id.hex() for pg in pgs}


def test_a_replica_killed_while_awake_is_replaced_and_nothing_is_lost(colocated, tiny_models):
    from manager_cases import wait_until_busy

    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = colocated
    loop.global_steps += 1
    loop.dispatch(prompt_batch([f"awake question {i}" for i in range(3)]))
    wait_until_busy(manager.rm_service)
    for replica in replicas_of(manager):
        ray.kill(replica, no_restart=True)
        break
    loop.global_steps -= 1
    batch = loop.train_step(None, batch_size=3)
    assert batch.metrics["async_rm/scored"] == 3 * N and batch.metrics["async_rm/errors"] == 0
    _check_exact(batch, tiny_models)
