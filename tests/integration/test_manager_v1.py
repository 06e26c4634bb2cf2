"""AsyncRMAgentLoopManager on verl's v1 trainer (the default): trajectories scored in TransferQueue, the step's
``async_rm/*`` metrics logged by a real verl ``Tracking`` at the step's number, validation apart, and the faults of
docs/faults.md's table (replica killed, executor killed, poisoned trajectory, request timeout) under
``on_error=raise``.

The loop is :class:`verl_async_rm.testing.V1FitLoop`: verl's own dispatch (``_submit_batch_to_rollout``), replay
buffer and the plugin's hook of ``PPOTrainer.step``, without the policy's GPU work. The RM is the
NaN-RM (the tiny RM whose ``</s>`` embedding is NaN): it scores like the tiny RM unless a response ends in ``</s>``,
which the ``poisoned`` agent loop (tests/integration/assets) makes happen.
"""

from __future__ import annotations

import json
import time

import pytest
import ray
from manager_cases import direct_scores, RM_W, RULE_W, replicas_of, running_manager, wait_until_busy

pytestmark = pytest.mark.integration

N = 2  # rollout.n


@pytest.fixture(scope="module")
def v1_loop(ray_local, tiny_models, nan_rm):
    from verl_async_rm.testing.v1 import V1FitLoop

    with running_manager(ray_local, tiny_models, "v1", rm_path=nan_rm[0]) as (manager, config):
        yield V1FitLoop(config, manager), manager


def test_scores_and_metrics_reach_verls_tracker_at_their_steps(v1_loop, tiny_models, nan_rm, tmp_path, monkeypatch):
    from verl.utils.tracking import Tracking

    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = v1_loop
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    loop.logger = Tracking(project_name="p", experiment_name="e", default_backend=["console", "file"])
    try:
        # step 1 dispatched as two batches (as verl's refills are): both count in step 1
        loop.dispatch(prompt_batch(["how many apples are left?", "what is the total cost?"]))
        first = loop.train_step(prompt_batch(["how fast is the train?"]), batch_size=3)
        val = loop.validate(prompt_batch(["a validation question", "another one"]))
        assert len(val.keys) == 2 and val.metrics["val-async_rm/scored"] == 2
        second = loop.train_step(prompt_batch(["a new question"]))
    finally:
        loop.logger.finish()
        loop.logger = None

    assert len(first.keys) == 3 * N and len(second.keys) == N
    for (direct, rule), i in zip(direct_scores(first, nan_rm[0], tiny_models.policy), range(len(first.keys)), strict=True):
        info = first.reward_extra_info(i)
        assert info["rm_score"] == pytest.approx(direct, abs=1e-4) and info["rule_score"] == pytest.approx(rule)
        assert first.reward(i) == pytest.approx(RM_W * direct + RULE_W * rule, abs=1e-4)

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {(row["step"], key): value for row in lines for key, value in row["data"].items()}
    # training figures at their step, validation (val_kwargs.n=1 per prompt) under its own prefix, never mixed in
    assert logged[(1, "async_rm/requests")] == 3 * N and logged[(1, "async_rm/scored")] == 3 * N
    assert logged[(1, "async_rm/errors")] == 0 and (1, "async_rm/rm_utilization") in logged
    assert logged[(1, "val-async_rm/requests")] == 2 and logged[(1, "val-async_rm/scored")] == 2
    assert logged[(2, "async_rm/requests")] == N and logged[(2, "async_rm/scored")] == N
    assert not any(key.startswith("val-async_rm/") for step, key in logged if step == 2)
    assert manager.last_metrics["async_rm/requests"] == N and manager.last_val_metrics["val-async_rm/requests"] == 2


def test_a_poisoned_trajectory_stops_the_run_at_the_end_of_its_step(v1_loop):
    import transfer_queue as tq

    from verl_async_rm.errors import RMScoreError
    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = v1_loop
    prompts = prompt_batch(["one", "two"], agent_names=["single_turn_agent", "poisoned"])
    uids = list(prompts["uid"])
    with pytest.raises(RMScoreError, match=rf"2 of 4 trajectories of step {loop.global_steps + 1}.*"
                                            rf"trajectory {uids[1]}/\d.*NonFiniteScoreError"):
        loop.train_step(prompts)
    # verl's failure path: only the poisoned group is 'failure'; nothing of the step is left in TransferQueue
    assert manager.last_metrics["async_rm/errors"] == 2 and manager.last_metrics["async_rm/scored"] == 2
    assert not tq.kv_list(partition_id="train").get("train")


def test_a_request_timeout_fails_the_step_under_raise(v1_loop):
    from verl_async_rm.errors import RMScoreError
    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = v1_loop
    integration = manager.async_rm_config.integration
    mix = manager.async_rm_config.mix
    ray.get([w.async_rm_attach.remote(manager.rm_services, mix, 1e-4, "raise") for w in manager.agent_loop_workers])
    try:
        with pytest.raises(RMScoreError, match="RequestTimeoutError"):
            loop.train_step(prompt_batch(["slow"]))
    finally:
        ray.get([w.async_rm_attach.remote(manager.rm_services, mix, integration.request_timeout_s, "raise")
                 for w in manager.agent_loop_workers])
        _clear("train")  # the run would stop here: verl's replay buffer left the failed group in TransferQueue
    assert loop.train_step(prompt_batch(["fast again"])).metrics["async_rm/scored"] == N


def _clear(partition: str) -> None:
    import transfer_queue as tq

    keys = list(tq.kv_list(partition_id=partition).get(partition, {}))
    if keys:
        tq.kv_clear(keys=keys, partition_id=partition)


def _wait_gone(actor, method: str = "ping") -> None:
    for _ in range(600):  # ray.kill returns at once: wait until the actor is really gone
        try:
            ray.get(getattr(actor, method).remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.05)


def test_a_dead_rm_service_is_replaced_at_the_next_dispatch(v1_loop):
    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = v1_loop
    old = manager.rm_service
    ray.kill(old)
    _wait_gone(old)
    batch = loop.train_step(prompt_batch(["after the service died", "and another"]))
    assert manager.rm_service is not old
    assert batch.metrics["async_rm/scored"] == 2 * N and batch.metrics["async_rm/errors"] == 0
    assert batch.metrics["async_rm/service_restarts_total"] >= 1
    assert all(batch.reward_extra_info(i)["rm_score"] == batch.reward_extra_info(i)["rm_score"]  # not NaN
               for i in range(len(batch.keys)))


def test_a_replica_killed_mid_step_loses_no_trajectory(v1_loop):
    """The first batch is held on replica 0 (a slow first call), killed there, re-queued and scored by the others."""
    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = v1_loop
    victim = replicas_of(manager)[0]
    loop.dispatch(prompt_batch([f"question {i}" for i in range(4)]))
    wait_until_busy(manager.rm_service)  # kill it while it (or its queue) holds this step's work
    ray.kill(victim)
    batch = loop.train_step(None, batch_size=4)
    assert len(batch.keys) == 4 * N
    assert batch.metrics["async_rm/scored"] == 4 * N and batch.metrics["async_rm/errors"] == 0
    assert all(batch.reward_extra_info(i)["rm_score"] == batch.reward_extra_info(i)["rm_score"]
               for i in range(len(batch.keys)))


def test_replicas_dead_before_a_step_are_replaced_and_their_batches_requeued(v1_loop):
    """Both replicas killed before the step: the batches sent to them come back, replacements load, all are scored."""
    from verl_async_rm.testing.v1 import prompt_batch

    loop, manager = v1_loop
    before = manager.last_metrics.get("async_rm/replicas_replaced_total", 0.0)
    # Every replica that answers is killed. One an earlier test killed is dead already: the service finds a dead
    # replica only when a batch is sent to it, so it may still be in its slot (describe() then shows an error).
    for info in ray.get(manager.rm_service.describe.remote(), timeout=60):
        if "actor_name" in info:
            replica = ray.get_actor(info["actor_name"])
            ray.kill(replica, no_restart=True)
            _wait_gone(replica, method="describe")
    batch = loop.train_step(prompt_batch(["after both replicas died", "and a second question"]))
    m = batch.metrics
    assert m["async_rm/scored"] == 2 * N and m["async_rm/errors"] == 0 and m["async_rm/requeued"] >= 1
    assert m["async_rm/replicas_replaced_total"] - before >= 1  # the other may still be loading
    assert all(batch.reward_extra_info(i)["rm_score"] == batch.reward_extra_info(i)["rm_score"]
               for i in range(len(batch.keys)))
