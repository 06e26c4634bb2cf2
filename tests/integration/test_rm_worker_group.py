"""The RM worker group on a local Ray cluster (CPU), with the tiny offline models.

One 2-replica group serves most tests (module-scoped: a replica takes ~10 s to start here). Its RM is the tiny RM
with the embedding of one rare token (``</s>``) set to NaN, so an input containing that token scores NaN and every
other input scores exactly as with the tiny RM. References are computed in this process with a plain HF forward
of one unpadded sequence; float32 on CPU, tolerance 1e-4 absolute and relative (batched vs single rows differ only
by summation order and thread count).
"""

from __future__ import annotations

from functools import partial

import pytest
import ray
from rm_cases import ANSWERS, direct_score, hf_model, make_batch, make_request

from verl_async_rm.errors import NonFiniteScoreError, ResourcePoolError, RewardModelError
from verl_async_rm.request import RMRequest
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.service.actors import call_replica
from verl_async_rm.service.placement import create_rm_worker_group, RMResourcePool, shutdown_rm_worker_group
from verl_async_rm.service.placement import reserve_placement_groups

pytestmark = pytest.mark.integration

ATOL = RTOL = 1e-4
MAX_LENGTH = 48


@pytest.fixture(scope="module")
def batch(policy_tok):
    return make_batch(policy_tok)


@pytest.fixture(scope="module")
def rm_group(ray_local, tiny_models, nan_rm):
    cfg = RMConfig(
        model_path=str(nan_rm[0]),
        policy_tokenizer_path=str(tiny_models.policy),
        use_gpu=False,
        n_gpus_per_node=2,
        nnodes=1,
        max_length=MAX_LENGTH,
        micro_batch_max_tokens=64,
        placement_timeout_s=60,
    )
    wg = create_rm_worker_group(cfg)
    yield wg, cfg
    shutdown_rm_worker_group(wg)


@pytest.fixture(scope="module")
def reference(tiny_models):
    return hf_model(tiny_models.rm)


def expected_scores(model, requests) -> list[float]:
    return [direct_score(model, (r.prompt_ids + r.response_ids)[-MAX_LENGTH:]) for r in requests]


@pytest.mark.asyncio
async def test_each_replica_scores_like_a_direct_hf_forward(rm_group, batch, reference):
    wg, cfg = rm_group
    assert len(wg.workers) == 2 == cfg.num_replicas
    batch_fn = partial(call_replica, grace_s=60.0)
    expected = expected_scores(reference, batch)
    for replica in wg.workers:  # per-replica actor handles, called directly
        assert await batch_fn(batch, replica) == pytest.approx(expected, abs=ATOL, rel=RTOL)


def test_replicas_describe_themselves(rm_group):
    wg, _ = rm_group
    infos = wg.describe()  # the whole-group ONE_TO_ALL path
    assert sorted(info["rank"] for info in infos) == [0, 1]
    assert all(info["loaded"] and info["device"] == "cpu" and info["retemplate"] is False for info in infos)
    assert all(info["dtype"] == "torch.float32" and info["max_length"] == MAX_LENGTH for info in infos)


@pytest.mark.asyncio
async def test_truncation_keeps_the_response_end(rm_group, policy_tok, reference, batch):
    wg, cfg = rm_group
    long = make_request(policy_tok, "how many apples does the farmer have " * 12, "so the answer is five", "long")
    assert long.num_tokens > MAX_LENGTH
    replica = wg.workers[0]
    await replica.pop_step_stats.remote()
    results = await partial(call_replica, grace_s=60.0)([long, batch[0]], replica)
    kept = (long.prompt_ids + long.response_ids)[-MAX_LENGTH:]
    assert kept[-len(long.response_ids) :] == long.response_ids
    assert results == pytest.approx(expected_scores(reference, [long, batch[0]]), abs=ATOL, rel=RTOL)
    step = await replica.pop_step_stats.remote()
    assert (step.requests, step.truncated, step.failed) == (2, 1, 0)


@pytest.mark.asyncio
async def test_a_nan_producing_input_fails_only_that_item(rm_group, nan_rm, batch, reference):
    wg, cfg = rm_group
    poison = nan_rm[1]
    bad = RMRequest("poisoned", batch[1].prompt_ids, [poison, *batch[1].response_ids], batch[1].raw_prompt)
    results = await partial(call_replica, grace_s=60.0)([batch[0], bad, batch[2]], wg.workers[1])
    assert isinstance(results[1], NonFiniteScoreError) and "poisoned" in str(results[1])
    assert [results[0], results[2]] == pytest.approx(expected_scores(reference, [batch[0], batch[2]]), abs=ATOL)



@pytest.mark.asyncio
async def test_template_switch_equals_rendering_by_hand(ray_local, tiny_models, batch):
    """rm_alt: other tokenizer and a Llama-3 template that renders BOS while its tokenizer adds BOS too."""
    from transformers import AutoTokenizer

    cfg = RMConfig(
        model_path=str(tiny_models.rm_alt), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False
    )
    alt_tok = AutoTokenizer.from_pretrained(tiny_models.rm_alt)
    model = hf_model(tiny_models.rm_alt)
    expected = []
    for request, answer in zip(batch, ANSWERS, strict=True):
        conversation = [*request.raw_prompt, {"role": "assistant", "content": answer}]
        text = alt_tok.apply_chat_template(conversation, tokenize=False).removeprefix(alt_tok.bos_token)
        ids = alt_tok(text)["input_ids"]
        assert ids.count(alt_tok.bos_token_id) == 1
        expected.append(direct_score(model, ids))
    wg = create_rm_worker_group(cfg)
    try:
        assert (await wg.workers[0].describe.remote())["retemplate"] is True
        results = await partial(call_replica, grace_s=60.0)(batch, wg.workers[0])
    finally:
        shutdown_rm_worker_group(wg)
    assert results == pytest.approx(expected, abs=ATOL, rel=RTOL)


def test_missing_resources_say_what_was_asked_and_what_the_cluster_has(ray_local):
    with pytest.raises(ResourcePoolError, match=r"needs 1 node\(s\) with \{CPU: 1, GPU: 1\}.*The cluster has: node"):
        RMResourcePool(1, 1, use_gpu=True).get_placement_groups()
    with pytest.raises(ResourcePoolError, match=r"needs 2 node\(s\).*1 node\(s\) have it"):
        RMResourcePool(1, 2, use_gpu=False).get_placement_groups()


def test_placement_timeout_is_an_error_and_leaks_nothing(ray_local):
    from ray.util.placement_group import placement_group_table

    before = set(placement_group_table())
    with pytest.raises(ResourcePoolError, match=r"not placed within 1s \(0 of 1 ready\).*The cluster has"):
        reserve_placement_groups(
            [[{"CPU": 1.0}]], node_ids=["f" * 56], strategy="STRICT_PACK", name_prefix="rm_test:", timeout_s=1
        )
    created = {k: v for k, v in placement_group_table().items() if k not in before}
    assert created and all(v["state"] == "REMOVED" for v in created.values())


def test_a_replica_that_cannot_load_fails_the_group_and_frees_the_pool(ray_local, tiny_models, tmp_path):
    cfg = RMConfig(model_path=str(tmp_path / "missing"), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False)
    pool = RMResourcePool.from_config(cfg)
    with pytest.raises(RewardModelError, match=r"RM replica 0 failed to load .*is not a directory"):
        create_rm_worker_group(cfg, pool=pool)
    assert pool.pgs is None


@ray.remote
class _Replica:
    """A stand-in replica whose ``score`` takes one of the failure paths (the replica call is what is under test).
    ``gated``: answers only once :meth:`release` is called; :meth:`started` returns once a call is inside ``score``."""

    def __init__(self, mode: str) -> None:
        import asyncio

        self.mode = mode
        self._inside, self._gate = asyncio.Event(), asyncio.Event()

    async def score(self, items):
        if self.mode == "raises":
            raise RewardModelError("the RM worker has no model yet: call init_model() first")
        if self.mode in ("gated", "never_answers"):
            self._inside.set()
            await self._gate.wait()  # never set for never_answers
            return [0.5] * len(items)
        return [0.5, ValueError("bad item"), "not a float"][: len(items)]

    async def started(self) -> bool:
        await self._inside.wait()
        return True

    async def release(self) -> None:
        self._gate.set()


@pytest.mark.asyncio
async def test_replica_call_failure_paths(ray_local, batch):
    stand_ins = {mode: _Replica.remote(mode) for mode in ("mixed", "raises", "gated", "never_answers")}
    try:
        await _failure_paths(partial(call_replica, grace_s=60.0), batch, stand_ins)
    finally:  # none may outlive the test (the soak test counts the cluster's actors)
        for replica in stand_ins.values():
            ray.kill(replica)


async def _failure_paths(call, batch, stand_ins) -> None:
    import asyncio

    from verl_async_rm.errors import ReplicaLostError

    mixed = stand_ins["mixed"]
    entries = await call(batch, mixed)  # the replica's answer as it is (the batcher checks its shape)
    assert entries[0] == 0.5 and isinstance(entries[1], ValueError) and entries[2] == "not a float"
    assert await call([], mixed) == []
    # the replica raised: an RM error for the whole batch, not a lost replica; typed, with its own cause (none here),
    # not Ray's wrapper as its cause
    with pytest.raises(RewardModelError, match="the RM worker has no model") as raised:
        await call(batch, stand_ins["raises"])
    assert not isinstance(raised.value, ReplicaLostError) and raised.value.__cause__ is None
    # the batcher gives up on a call (its batch_timeout_s) by cancelling it: the call then waits for the late answer,
    # so the replica gets no new batch meanwhile, and ends cancelled once the answer comes within the late limit ...
    gated = stand_ins["gated"]
    late = asyncio.ensure_future(call(batch, gated))
    await asyncio.wait_for(gated.started.remote(), 60.0)
    late.cancel()
    done, _ = await asyncio.wait({late}, timeout=0.5)  # the gate is closed: it cannot have answered
    assert not done, "the cancelled call returned before its replica answered"
    await gated.release.remote()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(late, 30.0)
    # ... or declares the replica lost when it stays silent past the limit (the batcher kills and replaces it)
    silent = asyncio.ensure_future(partial(call_replica, grace_s=0.5)(batch, stand_ins["never_answers"]))
    await asyncio.wait_for(stand_ins["never_answers"].started.remote(), 60.0)
    silent.cancel()
    with pytest.raises(ReplicaLostError, match="still had not answered a batch of 3 0.5s after it timed out"):
        await asyncio.wait_for(silent, 30.0)
    ray.kill(mixed)
    with pytest.raises(ReplicaLostError, match="RM replica is gone"):  # re-queued elsewhere by the batcher
        await call(batch, mixed)
