"""Faults of the RM replicas inside an RM service, on a local Ray cluster with the tiny RM on CPU.

- a replica dies while trajectories wait for it: its batch goes to the other replica, every trajectory is scored
  (equal to a direct HF forward), and a new replica is started in the dead one's bundle and takes batches;
- every replica dies and none can be replaced: every waiting trajectory fails with NoReplicasError at once;
- a replica does not answer within batch_timeout_s: its trajectories fail with RequestTimeoutError on time, and the
  replica gets no new batch until its call has answered (or is killed and replaced if it stays silent init_timeout_s).

The first two tests start a service of two replicas each (they kill replicas); the last two share one of one replica
(each replica is a process that imports verl and loads the RM: seconds of a 2-core machine). Replicas are found by
the actor names ``describe()`` gives. Waits are bounded (hang detectors, not speed checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
import ray
from rm_cases import ANSWERS, QUESTIONS, direct_score, hf_model, make_request, wait_stats

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.errors import NoReplicasError, RequestTimeoutError
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.client import score_with_timeout
from verl_async_rm.service.service import start_rm_service

pytestmark = pytest.mark.integration

ATOL = RTOL = 1e-4
HANG_S = 180.0  # hang detector for one wait; a replica loads in ~10 s here


@pytest.fixture
def rm_config(ray_local, tiny_models):
    return RMConfig(
        model_path=str(tiny_models.rm),
        policy_tokenizer_path=str(tiny_models.policy),
        use_gpu=False,
        n_gpus_per_node=2,
        nnodes=1,
        placement_timeout_s=60,
        init_timeout_s=120,
    )


def requests(policy_tok, n: int, tag: str):
    pairs = [(q, a) for q in QUESTIONS for a in ANSWERS]
    return [make_request(policy_tok, *pairs[i % len(pairs)], uid=f"{tag}{i}") for i in range(n)]


def service_for(cfg, policy: BatchPolicy, *, replace: bool):
    return start_rm_service(cfg, policy, name=f"faults_{time.monotonic_ns()}", replace_replicas=replace)


async def replicas(service) -> list:
    """The service's current replicas, by the actor names it reports."""
    return [ray.get_actor(info["actor_name"]) for info in await service.describe.remote()]


def stop(service) -> None:
    ray.get(service.close.remote(), timeout=HANG_S)
    ray.kill(service)


async def kill_and_wait(replica) -> None:
    """ray.kill, then wait until calls to the replica fail (the actor is really gone)."""
    ray.kill(replica, no_restart=True)
    for _ in range(600):
        try:
            await asyncio.wait_for(replica.describe.remote(), 5.0)
        except (ray.exceptions.RayActorError, asyncio.TimeoutError):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the killed replica still answers")


def expected_scores(tiny_models, reqs):
    model = hf_model(tiny_models.rm)
    return [direct_score(model, r.prompt_ids + r.response_ids) for r in reqs]


def test_a_replica_dying_under_its_batch_loses_no_trajectory_and_is_replaced(rm_config, tiny_models, policy_tok):
    cfg = rm_config
    first, second = requests(policy_tok, 16, "a"), requests(policy_tok, 16, "b")
    # 16 per batch and an hour of max_wait: the first 12 wait; the 4 others make the batch, which goes to replica 0
    service = service_for(cfg, BatchPolicy(max_batch_size=16, max_wait_ms=3_600_000), replace=True)

    async def main():
        waiting = [asyncio.ensure_future(score_with_timeout(service, r, timeout_s=HANG_S)) for r in first[:12]]
        await wait_stats(service, lambda s: s["queue_len"] == 12, "12 queued")
        await kill_and_wait((await replicas(service))[0])  # dies while its trajectories wait for it
        waiting += [asyncio.ensure_future(score_with_timeout(service, r, timeout_s=HANG_S)) for r in first[12:]]
        scores = await asyncio.gather(*waiting)
        after_loss = await service.stats.remote()
        replaced = await wait_stats(service, lambda s: s["replicas_replaced_total"] == 1, "replica 0 replaced")
        info = (await asyncio.wait_for(service.describe.remote(), 60))[0]
        again = await asyncio.gather(*(score_with_timeout(service, r, timeout_s=HANG_S) for r in second))
        final = await service.stats.remote()
        return scores, after_loss, replaced, info, again, final

    try:
        scores, after_loss, replaced, info, again, final = asyncio.run(main())
    finally:
        stop(service)
    assert scores == pytest.approx(expected_scores(tiny_models, first), abs=ATOL, rel=RTOL)
    assert after_loss["completed"] == 16 and after_loss["failed"] == 0
    assert after_loss["requeued"] == 16 and after_loss["replicas_lost_total"] == 1
    assert replaced["replicas_free"] == 2 and replaced["replicas_lost"] == 0
    assert info["model_path"] == cfg.model_path
    assert again == pytest.approx(expected_scores(tiny_models, second), abs=ATOL, rel=RTOL)
    assert final["completed"] == 32 and final["failed"] == 0


def test_with_every_replica_dead_and_none_replaceable_waiters_fail_at_once(rm_config, policy_tok):
    service = service_for(rm_config, BatchPolicy(max_batch_size=4, max_wait_ms=3_600_000), replace=False)
    reqs = requests(policy_tok, 6, "c")

    async def main():
        waiting = [asyncio.ensure_future(score_with_timeout(service, r, timeout_s=HANG_S)) for r in reqs[:3]]
        await wait_stats(service, lambda s: s["queue_len"] == 3, "3 queued")
        for worker in await replicas(service):
            await kill_and_wait(worker)
        t0 = time.monotonic()
        waiting += [asyncio.ensure_future(score_with_timeout(service, r, timeout_s=HANG_S)) for r in reqs[3:]]
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        elapsed = time.monotonic() - t0
        late = await asyncio.gather(score_with_timeout(service, reqs[0], timeout_s=HANG_S), return_exceptions=True)
        return outcomes, elapsed, late[0], await service.stats.remote()

    try:
        outcomes, elapsed, late, stats = asyncio.run(main())
    finally:
        stop(service)
    assert all(isinstance(o, NoReplicasError) for o in outcomes), outcomes
    assert "all 2 replica(s)" in str(outcomes[0])
    assert elapsed < HANG_S / 4  # long before any deadline: they did not wait for one
    assert isinstance(late, NoReplicasError)
    assert stats["replicas_lost"] == 2 and stats["completed"] == 0


@pytest.fixture(scope="module")
def late_service(ray_local, tiny_models):
    """One replica and a batch timeout no real call can meet (every batch times out; the replica stays late until its
    call ends): the last two tests in turn, a replica late and then one silent. A late replica's call gets
    ``init_timeout_s`` to answer before the replica counts as lost, which is also a replacement's time to load: 20 s
    was once too short for this 2-core machine under the suite's load (the replacement failed); 45 s leaves it room."""
    cfg = RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                   n_gpus_per_node=1, nnodes=1, placement_timeout_s=60, init_timeout_s=45)
    service = service_for(cfg, BatchPolicy(max_batch_size=4, max_wait_ms=0, batch_timeout_s=1e-4), replace=True)
    yield service
    stop(service)


def test_a_replica_past_batch_timeout_fails_its_batch_on_time_and_is_not_reused_until_it_answers(
    late_service, policy_tok
):
    service, reqs = late_service, requests(policy_tok, 4, "d")

    async def main():
        outcomes = await asyncio.gather(
            *(score_with_timeout(service, r, timeout_s=HANG_S) for r in reqs), return_exceptions=True
        )
        return outcomes, await service.stats.remote()

    outcomes, stats = asyncio.run(main())
    assert all(isinstance(o, RequestTimeoutError) and "batch_timeout_s" in str(o) for o in outcomes), outcomes
    assert stats["timed_out"] == 4 and stats["replicas_timed_out_total"] == stats["batches"] >= 1
    # the replica's calls end (the RM is fast): it takes batches again; nothing was lost or replaced
    settled = asyncio.run(wait_stats(service, lambda s: s["replicas_free"] == 1, "the late replica back"))
    assert settled["replicas_lost"] == settled["replicas_timed_out"] == settled["replicas_replaced_total"] == 0


def test_a_replica_silent_past_its_grace_is_killed_and_replaced(late_service, policy_tok):
    # A replica that really stops answering: its process is frozen (SIGSTOP) before the batch reaches it. The batch
    # fails at batch_timeout_s; the replica gets init_timeout_s more to answer, then counts as lost: killed and replaced.
    service, reqs = late_service, requests(policy_tok, 1, "e")
    frozen: list[int] = []

    async def main():
        start = await service.stats.remote()
        before = await replicas(service)
        pid = (await service.describe.remote())[0]["pid"]  # the one replica takes the batch
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)
        outcome = await asyncio.gather(score_with_timeout(service, reqs[0], timeout_s=HANG_S), return_exceptions=True)
        replaced = await wait_stats(service, lambda s: s["replicas_replaced_total"] >= 1, "a replica replaced")
        return outcome[0], start, replaced, before, await replicas(service)

    try:
        outcome, start, replaced, before, after = asyncio.run(main())
    finally:
        for pid in frozen:  # let a frozen replica that was not killed go on, so that it can be stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert isinstance(outcome, RequestTimeoutError) and "batch_timeout_s" in str(outcome), outcome
    assert replaced["replicas_lost_total"] - start["replicas_lost_total"] == 1
    assert replaced["replicas_timed_out_total"] - start["replicas_timed_out_total"] == 1
    assert [w for w in before if w not in after] == [before[0]], "the frozen replica was swapped for a new one"
    with pytest.raises(ray.exceptions.RayActorError):  # the silent replica was killed, not left running
        ray.get(before[0].describe.remote(), timeout=60)
