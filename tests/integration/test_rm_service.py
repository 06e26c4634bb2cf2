"""The RM service as a Ray actor with two real CPU replicas of the tiny RM: many callers at once (the driver and
worker actors), its step marks, and typed errors crossing Ray (deadline, cancel, closed). Faults of the replicas are in
test_rm_faults.py."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import pytest
from rm_cases import ANSWERS, QUESTIONS, direct_score, hf_model, make_request

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.errors import BatcherClosedError, RequestTimeoutError, RewardInputError
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.client import score_with_timeout
from verl_async_rm.service.service import start_rm_service

pytestmark = pytest.mark.integration

ATOL = RTOL = 1e-4
CALL_TIMEOUT_S = 120.0


class Caller:
    """An agent-loop worker stand-in: many concurrent trajectories, each scored with one call."""

    def __init__(self, service) -> None:
        self.service = service

    async def run(self, requests: list) -> list:
        return await asyncio.gather(*(score_with_timeout(self.service, r, timeout_s=CALL_TIMEOUT_S) for r in requests))


@pytest.fixture
def rm_config(ray_local, tiny_models):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    try:
        yield RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                       n_gpus_per_node=2, nnodes=1, placement_timeout_s=60, init_timeout_s=120)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def trajectories(policy_tok, n: int, tag: str) -> list[RMRequest]:
    pairs = [(q, a) for q in QUESTIONS for a in ANSWERS]
    return [make_request(policy_tok, *pairs[i % len(pairs)], uid=f"{tag}{i}") for i in range(n)]


def expected(tiny_models, requests) -> list[float]:
    model = hf_model(tiny_models.rm)
    cache: dict[tuple, float] = {}
    for r in requests:
        ids = tuple(r.prompt_ids + r.response_ids)
        if ids not in cache:
            cache[ids] = direct_score(model, list(ids))
    return [cache[tuple(r.prompt_ids + r.response_ids)] for r in requests]


def stop(ray, service) -> None:
    ray.get(service.close.remote(), timeout=CALL_TIMEOUT_S)
    ray.kill(service)


def test_many_callers_share_one_service_and_its_step_figures_count_them(rm_config, tiny_models, policy_tok):
    import ray

    service = start_rm_service(rm_config, BatchPolicy(max_batch_size=16, max_wait_ms=20), name="svc_many")
    local, remote = trajectories(policy_tok, 300, "l"), [trajectories(policy_tok, 100, f"r{k}") for k in range(2)]
    bad = RMRequest(uid="bad/0", prompt_ids=[1, 2], response_ids=[10**7])  # an id no tokenizer has

    async def main():
        await service.begin_step.remote(len(local) + 1)
        # each caller gets the service's handle, as verl's agent-loop workers do
        callers = [ray.remote(Caller).options(num_cpus=0).remote(service) for _ in remote]
        runs = [c.run.remote(batch) for c, batch in zip(callers, remote, strict=True)]
        mine = asyncio.gather(*(score_with_timeout(service, r, timeout_s=CALL_TIMEOUT_S) for r in local))
        scores, *theirs = await asyncio.wait_for(asyncio.gather(mine, *runs), CALL_TIMEOUT_S * 2)
        # a per-item error reaches its caller as its own type, a value: the call raises only for a lost service
        assert isinstance(await score_with_timeout(service, bad, timeout_s=CALL_TIMEOUT_S), RewardInputError)
        step = await service.end_step.remote()
        described = await service.describe.remote()
        for caller in callers:
            ray.kill(caller)
        return scores, theirs, step, described, await service.stats.remote()

    try:
        scores, theirs, step, described, stats = asyncio.run(main())
    finally:
        stop(ray, service)
    assert scores == pytest.approx(expected(tiny_models, local), abs=ATOL, rel=RTOL)
    for batch, got in zip(remote, theirs, strict=True):
        assert got == pytest.approx(expected(tiny_models, batch), abs=ATOL, rel=RTOL)
    assert step["requests"] == 501 and step["scored"] == 500 and step["errors"] == 1
    assert step["rm_failed_items"] == 1 and step["truncated"] == 0 and step["replicas_usable"] == 2
    assert 1 <= step["mean_batch_size"] <= 16 and step["batches"] >= 501 / 16
    assert stats["completed"] == 500 and stats["failed"] == 1 and stats["queue_len"] == 0
    assert [d["rank"] for d in described] == [0, 1] and all(d["loaded"] and d["actor_name"] for d in described)


def test_typed_errors_cross_ray_deadline_cancel_and_close(rm_config, policy_tok):
    import ray

    # an hour of max_wait: the first request waits, deterministically, until the test acts (nothing is scored: one
    # replica is enough)
    policy = BatchPolicy(max_batch_size=64, max_wait_ms=3_600_000)
    service = start_rm_service(dataclasses.replace(rm_config, n_gpus_per_node=1), policy, name="svc_errors")
    first, second, third = trajectories(policy_tok, 3, "e")

    async def wait_stats(predicate) -> dict:
        for _ in range(600):  # bounded: a hang detector, not a speed check
            stats = await service.stats.remote()
            if predicate(stats):
                return stats
            await asyncio.sleep(0.05)
        raise AssertionError(f"condition never held; last stats {stats}")

    async def main():
        waiting = service.score.remote(first, deadline_s=CALL_TIMEOUT_S)
        await wait_stats(lambda s: s["queue_len"] == 1)
        ray.cancel(waiting)  # a caller that gives up takes its request out of the queue
        cancelled = await wait_stats(lambda s: s["cancelled"] == 1)
        with pytest.raises(ray.exceptions.TaskCancelledError):
            await asyncio.wait_for(waiting, CALL_TIMEOUT_S)
        late = await score_with_timeout(service, second, timeout_s=0.5)
        assert isinstance(late, RequestTimeoutError) and "missed its deadline" in str(late), late
        last = service.score.remote(third, deadline_s=CALL_TIMEOUT_S)
        await wait_stats(lambda s: s["queue_len"] == 1)
        await service.close.remote()
        assert isinstance(await asyncio.wait_for(last, CALL_TIMEOUT_S), BatcherClosedError)
        return cancelled

    try:
        cancelled = asyncio.run(main())
    finally:
        stop(ray, service)
    assert cancelled["queue_len"] == 0 and cancelled["rejected"] == 0
