"""Faults through the whole v0 integration (verl's agent loop and reward loop, the RM pool, the RM service).

The manager here runs the NaN-RM (the tiny RM whose ``</s>`` embedding is NaN) with ``on_error=drop`` and
``drop_budget=0.5``; trajectories run by the ``poisoned`` agent loop (tests/integration/assets) end in ``</s>``, so
their RM score fails while their group mates score normally.
"""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest
import ray
import torch
from manager_cases import prompts_batch, running_manager

from verl_async_rm.errors import RMServiceLostError, TrajectoryDroppedError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def drop_manager(ray_wide, tiny_models, nan_rm):
    with running_manager(ray_wide, tiny_models, "v0", "+async_rm.on_error=drop", "+async_rm.drop_budget=0.5",
                         rm_path=nan_rm[0]) as (manager, config):
        yield manager, config


def last_token(output, i: int) -> int:
    prompt_len = output.batch["prompts"].shape[1]
    return int(output.batch["attention_mask"][i, prompt_len:].sum()) - 1


def test_a_dropped_trajectory_is_excluded_and_its_group_mean_kept(drop_manager):
    manager, _ = drop_manager
    names = ["single_turn_agent", "poisoned", "single_turn_agent", "single_turn_agent", "poisoned",
             "single_turn_agent"]
    output = manager.generate_sequences(prompts_batch(3, rollout_n=2, agent_names=names))
    dropped = np.asarray(output.non_tensor_batch["rm_dropped"], dtype=float)
    assert dropped.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert "NonFiniteScoreError" in output.non_tensor_batch["rm_error"][1]
    assert output.non_tensor_batch["rm_error"][0] == ""
    totals = output.batch["rm_scores"].sum(dim=-1)
    assert bool(torch.isfinite(output.batch["rm_scores"]).all())
    for i in (0, 2, 3, 5):  # scored normally, and trained on
        assert math.isfinite(float(output.non_tensor_batch["rm_score"][i]))
        assert int(output.batch["response_mask"][i].sum()) > 0
    for i, mate in ((1, 0), (4, 5)):  # dropped: no loss, and the reward of its only scored group mate
        assert int(output.batch["response_mask"][i].sum()) == 0
        assert float(totals[i]) == pytest.approx(float(totals[mate]))
        assert float(output.batch["rm_scores"][i, last_token(output, i)]) == pytest.approx(float(totals[mate]))
    assert output.meta_info["timing"]["async_rm/dropped"] == 2.0


def test_more_drops_than_the_budget_fail_the_step(drop_manager):
    manager, _ = drop_manager
    names = ["poisoned"] * 4 + ["single_turn_agent"] * 2
    with pytest.raises(TrajectoryDroppedError, match="4 of 6 trajectories"):
        manager.generate_sequences(prompts_batch(3, rollout_n=2, agent_names=names))


def test_a_dead_rm_service_is_replaced_at_the_next_step(drop_manager):
    manager, _ = drop_manager
    old = manager.rm_service
    ray.kill(old)
    for _ in range(600):  # ray.kill returns at once: wait until the actor is really gone
        try:
            ray.get(old.ping.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break
        time.sleep(0.05)
    output = manager.generate_sequences(prompts_batch(2, rollout_n=2))
    assert manager.rm_service is not old
    assert np.asarray(output.non_tensor_batch["rm_dropped"], dtype=float).tolist() == [0.0] * 4
    timing = output.meta_info["timing"]
    assert timing["async_rm/service_restarts_total"] == 1.0
    assert timing["async_rm/scored"] == 4.0
    assert timing["async_rm/replicas_usable"] == 1.0  # the new service's whole pool


def test_a_trajectory_waiting_on_an_rm_service_that_dies_fails_at_once(ray_wide, tiny_models, policy_tok):
    from rm_cases import make_request
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from verl_async_rm.service.batching import BatchPolicy
    from verl_async_rm.integration.agent_loop_worker import AsyncRMWorkerMixin
    from verl_async_rm.reward_mix import RewardMix
    from verl_async_rm.scoring.rm_config import RMConfig
    from verl_async_rm.service.service import start_rm_service

    rm = RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                  n_gpus_per_node=1, placement_timeout_s=60, init_timeout_s=120)
    # an hour of max_wait: the request waits in the service until the service dies
    service = start_rm_service(rm, BatchPolicy(max_batch_size=64, max_wait_ms=3_600_000), name="dies")
    worker = AsyncRMWorkerMixin()
    request = make_request(policy_tok, "how many apples", "five", "x0")

    final = AgentLoopOutput(prompt_ids=request.prompt_ids, response_ids=request.response_ids,
                            response_mask=[1] * len(request.response_ids), num_turns=2, metrics=AgentLoopMetrics())

    async def main():
        await worker.async_rm_attach({"main": service}, RewardMix(), request_timeout_s=600.0)
        waiting = asyncio.ensure_future(worker._async_rm_scores(final, {"uid": "x", "raw_prompt": None}, "x/0"))
        for _ in range(600):  # bounded: until the request is in the service's queue
            if (await service.stats.remote())["queue_len"] == 1:
                break
            await asyncio.sleep(0.05)
        assert not waiting.done()
        t0 = time.monotonic()
        ray.kill(service)
        scores, failure = await asyncio.wait_for(waiting, 60.0)
        assert scores == {} and isinstance(failure, RMServiceLostError), failure
        assert "the RM service of RM 'main' died" in str(failure)
        return time.monotonic() - t0

    from verl_async_rm.service.placement import remove_pool_groups

    try:
        elapsed = asyncio.run(main())
    finally:
        remove_pool_groups("dies_", 1)  # the dead service's placement group lives as long as the job
    assert elapsed < 30.0  # at once, not after request_timeout_s (600 s)
