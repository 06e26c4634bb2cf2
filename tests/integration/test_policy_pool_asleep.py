"""A trajectory that reaches the RM on the policy's GPUs while it sleeps waits for the wake, and is then scored
exactly.

This one test keeps the stubbed fit loop (:class:`verl_async_rm.testing.V1FitLoop` with a synthetic generation server
and a stand-in policy pool): it must hold the RM asleep while a trajectory arrives and check that no batch forms in the
meantime, which needs control over when the sleep and the wake happen. In verl's real trainer the RM sleeps only
between the sampling and the end of the step, when no trajectory of the step is left to arrive; everything else
about the policy's GPUs runs through verl's real trainer in ``test_manager_v1.py``.

The policy pool is verl's own ``RayResourcePool`` named as verl's trainer names it (``global_pool``), holding a verl
``Worker`` per bundle in the actor's place; its bundles are CPU-only and hold 2 processes each.
"""

from __future__ import annotations

import time

import pytest
import ray
from manager_cases import RM_W, RULE_W, direct_scores, running_manager

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
             "trainer.nnodes=1", f"reward.reward_model.n_gpus_per_node={POLICY_GPUS}")  # verl's size: the trainer's
    with running_manager(ray_local, tiny_models, "v1", *extra) as (manager, config):
        yield V1FitLoop(config, manager), manager


def _check_exact(batch, tiny_models):
    for i, (direct, rule) in enumerate(direct_scores(batch, tiny_models.rm, tiny_models.policy)):
        info = batch.reward_extra_info(i)
        assert info["rm_score"] == pytest.approx(direct, abs=1e-4)
        assert batch.reward(i) == pytest.approx(RM_W * direct + RULE_W * rule, abs=1e-4)


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
