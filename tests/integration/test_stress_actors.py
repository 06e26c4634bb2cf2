"""Stress through the real Ray actors: thousands of requests from concurrent callers into an RM service with two
real CPU replicas of the tiny RM, with random arrivals, per-item failures, cancellations and replica kills (each
killed replica is replaced by the service). Every request must resolve exactly once, and every score must equal the
plain-transformers score of its trajectory.

The batcher's exactly-once guarantee at 10^4 requests with failures, cancellations and lost replicas is fuzzed on the
virtual clock (tests/unit/test_batcher_fuzz.py); this test is the same guarantee across Ray: the service actor, its
replica calls, the replacement path and ``score_with_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter

import pytest
import ray
from rm_cases import ANSWERS, QUESTIONS, direct_score, hf_model, make_request

from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.errors import NoReplicasError, RequestTimeoutError, RewardInputError, ReplicaLostError
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.client import score_with_timeout
from verl_async_rm.service.service import start_rm_service

pytestmark = pytest.mark.integration
logger = logging.getLogger(__name__)

N_REQUESTS = 3000
FAIL_EVERY = 23  # requests with id % 23 == 0 carry a token id no tokenizer has: the replica fails that item alone
CANCEL_FRACTION = 0.05
KILLS = 3
HANG_S = 300.0


def test_thousands_of_requests_resolve_exactly_once_through_the_service(ray_wide, tiny_models, policy_tok):
    rng = random.Random(1234)
    cfg = RMConfig(model_path=str(tiny_models.rm), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                   n_gpus_per_node=2, nnodes=1, placement_timeout_s=60, init_timeout_s=120)
    service = start_rm_service(cfg, BatchPolicy(max_batch_size=32, max_batch_tokens=1024, max_wait_ms=5,
                                                replica_retries=3), name="stress")
    pairs = [(q, a) for q in QUESTIONS for a in ANSWERS]
    model = hf_model(tiny_models.rm)
    cases = [make_request(policy_tok, q, a, uid="case") for q, a in pairs]
    expected = [direct_score(model, c.prompt_ids + c.response_ids) for c in cases]

    def request(i: int) -> RMRequest:
        case = cases[i % len(cases)]
        response = [10**7] if i % FAIL_EVERY == 0 else case.response_ids
        return RMRequest(uid=f"p{i // 4}/{i % 4}", prompt_ids=case.prompt_ids, response_ids=response,
                         raw_prompt=case.raw_prompt, group=f"p{i // 4}")

    arrivals = [rng.expovariate(1.0 / 0.0015) for _ in range(N_REQUESTS)]  # ~650 requests/s for ~5 s
    cancel_at = {i: rng.uniform(0.0, 0.05) for i in rng.sample(range(N_REQUESTS), int(CANCEL_FRACTION * N_REQUESTS))}
    outcomes: dict[int, list] = {i: [] for i in range(N_REQUESTS)}

    async def one(i: int) -> None:
        try:
            value = await score_with_timeout(service, request(i), timeout_s=120.0)
            outcomes[i].append(("error" if isinstance(value, BaseException) else "ok", value))  # errors are values
        except asyncio.CancelledError:
            outcomes[i].append(("cancelled", None))
        except Exception as exc:  # noqa: BLE001 - only a lost service raises: recorded, and fails the check below
            outcomes[i].append(("raised", exc))

    async def killer(stop: asyncio.Event) -> int:
        kills = 0
        while kills < KILLS and not stop.is_set():
            await asyncio.sleep(1.5)
            infos = await asyncio.wait_for(service.describe.remote(), 30)
            alive = [info["actor_name"] for info in infos if "actor_name" in info]
            if alive:
                ray.kill(ray.get_actor(rng.choice(alive)), no_restart=True)
                kills += 1
        return kills

    async def main():
        stop = asyncio.Event()
        kill_task = asyncio.ensure_future(killer(stop))
        tasks = []
        for i in range(N_REQUESTS):
            await asyncio.sleep(arrivals[i])
            task = asyncio.ensure_future(one(i))
            tasks.append(task)
            if i in cancel_at:
                asyncio.get_running_loop().call_later(cancel_at[i], task.cancel)
        _, pending = await asyncio.wait(tasks, timeout=HANG_S)
        stop.set()
        kills = await kill_task
        stats = None
        for _ in range(100):  # cancelled calls settle in the service a moment after the callers gave up
            stats = await asyncio.wait_for(service.stats.remote(), 30)
            if stats["in_flight_requests"] == 0 and stats["queue_len"] == 0:
                break
            await asyncio.sleep(0.1)
        return len(pending), kills, stats

    t0 = time.monotonic()
    try:
        pending, kills, stats = asyncio.run(main())
    finally:
        ray.get(service.close.remote(), timeout=HANG_S)
        ray.kill(service)
    elapsed = time.monotonic() - t0

    assert pending == 0, "a caller never got an answer"
    assert all(len(v) == 1 for v in outcomes.values()), "a caller got more than one outcome"
    kinds: Counter = Counter()
    for i, [(kind, value)] in outcomes.items():
        if kind == "ok":
            assert i % FAIL_EVERY != 0 and value == pytest.approx(expected[i % len(cases)], abs=1e-4), (i, value)
            kinds["scored"] += 1
        elif kind == "cancelled":
            assert i in cancel_at
            kinds["cancelled"] += 1
        elif isinstance(value, RewardInputError):
            assert i % FAIL_EVERY == 0
            kinds["item_failed"] += 1
        else:  # a replica killed under the same request more than replica_retries times; nothing else is allowed
            assert kind == "error", (kind, value)
            assert (
                isinstance(value, ReplicaLostError) and not isinstance(value, (NoReplicasError, RequestTimeoutError))
            ), value
            kinds["replica_lost"] += 1
    # service side: every request it accepted was settled exactly once (each settle bumps exactly one counter)
    settled = stats["completed"] + stats["failed"] + stats["timed_out"] + stats["cancelled"]
    assert stats["submitted"] == settled and stats["in_flight_requests"] == 0 and stats["queue_len"] == 0
    assert stats["submitted"] <= N_REQUESTS  # a caller cancelled before its call reached the actor never counts
    assert kills == KILLS and stats["replicas_lost_total"] >= 1 and stats["replicas_replaced_total"] >= 1
    assert kinds["scored"] + kinds["item_failed"] + kinds["cancelled"] + kinds["replica_lost"] == N_REQUESTS
    assert kinds["scored"] > N_REQUESTS / 2
    logger.warning(
        "stress: %d requests in %.1f s: %s; service: submitted %d, completed %d, failed %d, timed_out %d, "
        "cancelled %d, requeued %d, batches %d, replicas killed %d, lost %d, replaced %d",
        N_REQUESTS, elapsed, dict(kinds), stats["submitted"], stats["completed"], stats["failed"],
        stats["timed_out"], stats["cancelled"], stats["requeued"], stats["batches"], kills,
        stats["replicas_lost_total"], stats["replicas_replaced_total"],
    )
