"""``RMService`` in this process (the Ray actor's class, no Ray) with its real batcher over a scripted replica: a
per-response judge whose verdict does not parse is asked again in its conversation, a group judge's members wait in the
gate and reach the replica as one request per group (judged without a withdrawn sibling as soon as the rest are in),
and each step's figures count trajectories, not judge calls; a deadline that passes in the service before the
batcher is a timeout. A
group judge's service on real vLLM in verl's trainer: ``tests/integration/test_cpu_recipe_v0.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from verl_async_rm.errors import JudgeVerdictError, RequestTimeoutError
from verl_async_rm.request import GroupRequest, GroupVerdict, RMRequest, Verdict
from verl_async_rm.scoring.rm_config import RMConfig
from verl_async_rm.scoring.batch import ScorerStats
from verl_async_rm.service.batcher import Batcher
from verl_async_rm.service.batching import BatchPolicy
from verl_async_rm.service.service import RMService

pytestmark = pytest.mark.unit


class ScriptedReplica:
    """Answers batches as a judge's replica would: a trajectory's verdict does not parse until it is re-asked; a
    group gets each member's session index; counts what a scorer counts."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.group_reasks = False  #: a group's first reply does not read
        self.step = self._zero()
        self.pop_step_stats = SimpleNamespace(remote=self._pop)

    @staticmethod
    def _zero() -> ScorerStats:
        return ScorerStats(judge_tokens=0, judge_parse_failures=0, judge_cut_replies=0)

    async def _pop(self) -> ScorerStats:
        step, self.step = self.step, self._zero()
        return step

    async def score(self, items, replica, deadline):
        self.batches.append(list(items))
        out = []
        for item in items:
            self.step.requests += 1
            self.step.tokens += 100
            self.step.judge_tokens += 10
            if isinstance(item, GroupRequest) and (item.reask is not None or not self.group_reasks):
                out.append(GroupVerdict(tuple(float(m.uid[-1]) for m in item.members),
                                        tuple(f'[{label}] {{"1": 0}}' for label in range(1, len(item.members) + 1))))
            elif isinstance(item, GroupRequest):
                self.step.judge_parse_failures += 1
                out.append(JudgeVerdictError("label 2 is missing", reply='{"1": 3}', reason="label 2 is missing"))
            elif item.reask is None:
                self.step.judge_parse_failures += 1
                out.append(JudgeVerdictError("no match", reply="I like it", reason="no match of judge_pattern"))
            else:
                out.append(Verdict(4.0, "Verdict: 4"))
        return out


def service_of(tiny_models, tiny_judges, **settings) -> tuple[RMService, ScriptedReplica]:
    rm = RMConfig(model_path=str(tiny_judges.json), policy_tokenizer_path=str(tiny_models.policy), use_gpu=False,
                  **settings)
    service = RMService(rm, BatchPolicy(max_batch_size=8, max_wait_ms=1), name="judges_test")
    replica = ScriptedReplica()
    service._batcher = Batcher(replica.score, service._batching, replicas=[replica], name="judges_test")
    return service, replica


def trajectory(group: str, j: int, size: int | None = None) -> RMRequest:
    return RMRequest(uid=f"{group}/{j}", prompt_ids=[1, 2], response_ids=[3, 4], group=group, group_size=size)


@pytest.mark.asyncio
async def test_a_per_response_judge_is_asked_again_with_its_reply_and_the_figures_count_trajectories(
        tiny_models, tiny_judges):
    service, replica = service_of(tiny_models, tiny_judges, reward_kind="judge", judge_readout="generate",
                                  judge_retries=1)
    results = await asyncio.gather(*(service.score(trajectory(f"g{i}", 0), 30.0) for i in range(3)))
    figures = await service.end_step()
    await service._batcher.aclose()
    assert results == [Verdict(4.0, "Verdict: 4")] * 3
    asked_again = [item for batch in replica.batches for item in batch if item.reask is not None]
    assert [item.reask for item in asked_again] == [("I like it", "no match of judge_pattern")] * 3
    assert (figures["requests"], figures["scored"], figures["errors"], figures["judge_reasks"]) == (3, 3, 0, 3)
    assert (figures["judge_calls"], figures["judge_parse_failures"], figures["judge_tokens"]) == (6, 3, 60)
    assert figures["judge_tokens_in_per_trajectory"] == 200 and figures["judge_tokens_out_per_trajectory"] == 20


@pytest.mark.asyncio
async def test_a_group_judges_members_reach_the_replica_as_one_request_per_group(tiny_models, tiny_judges):
    service, replica = service_of(tiny_models, tiny_judges, reward_kind="group_judge")
    members = [trajectory(f"g{g}", j, 3) for g in range(2) for j in range(3)]
    results = await asyncio.gather(*(service.score(m, 30.0) for m in members))
    figures = await service.end_step()
    await service._batcher.aclose()
    assert [r.score for r in results] == [0.0, 1.0, 2.0] * 2
    sent = [item for batch in replica.batches for item in batch]
    assert all(isinstance(item, GroupRequest) for item in sent) and sorted(i.group for i in sent) == ["g0", "g1"]
    assert (figures["requests"], figures["scored"], figures["groups_judged"], figures["judge_calls"]) == (6, 6, 2, 2)
    assert figures["judge_tokens_in_per_trajectory"] == pytest.approx(200 / 6) and figures["judge_reasks"] == 0
    assert "group_wait_s/p99" in figures and figures["reward_tail_s"] >= 0


@pytest.mark.asyncio
async def test_a_withdrawn_sibling_lets_its_group_be_judged_without_waiting_for_it(tiny_models, tiny_judges):
    service, replica = service_of(tiny_models, tiny_judges, reward_kind="group_judge")  # group_wait_s: 300 s
    await service.withdraw("g", 3)  # its agent loop failed
    results = await asyncio.wait_for(asyncio.gather(*(service.score(trajectory("g", j, 3), 30.0) for j in (0, 1))),
                                     10.0)
    await service._batcher.aclose()
    assert [r.score for r in results] == [0.0, 1.0]
    [[group]] = replica.batches
    assert isinstance(group, GroupRequest) and [m.uid for m in group.members] == ["g/0", "g/1"]


@pytest.mark.asyncio
async def test_a_deadline_that_passes_in_the_service_before_the_batcher_is_a_timeout(tiny_models, tiny_judges):
    """The actor loses its core between reading the deadline and asking the batcher (as on a loaded machine): the
    trajectory gets ``RequestTimeoutError``, the error of a missed deadline, counted in the step's figures like any
    (not a ``ValueError``, which the agent loop would take for a bug)."""
    service, replica = service_of(tiny_models, tiny_judges, reward_kind="judge", judge_readout="generate")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    clock = iter([t0])  # the deadline is read at t0; the next reading is a second later
    loop.time = lambda: next(clock, t0 + 1.0)
    try:
        result = await service.score(trajectory("g", 0), 0.5)
    finally:
        del loop.time
    figures = await service.end_step()
    await service._batcher.aclose()
    assert isinstance(result, RequestTimeoutError) and "missed its deadline" in str(result), repr(result)
    assert (figures["requests"], figures["scored"], figures["errors"]) == (1, 0, 1)


@pytest.mark.asyncio
async def test_a_group_whose_reply_does_not_read_is_asked_again_by_the_same_rule_as_a_trajectory(tiny_models,
                                                                                                 tiny_judges):
    service, replica = service_of(tiny_models, tiny_judges, reward_kind="group_judge", judge_retries=2)
    replica.group_reasks = True
    results = await asyncio.gather(*(service.score(trajectory("g", j, 2), 30.0) for j in range(2)))
    figures = await service.end_step()
    await service._batcher.aclose()
    sent = [item for batch in replica.batches for item in batch]
    assert [item.reask for item in sent] == [None, ('{"1": 3}', "label 2 is missing")]
    assert sent[0].members == sent[1].members and [r.score for r in results] == [0.0, 1.0]
    assert (figures["judge_calls"], figures["judge_reasks"], figures["scored"], figures["errors"]) == (2, 1, 2, 0)


@pytest.mark.asyncio
async def test_no_re_ask_is_made_once_the_deadline_has_passed(tiny_models, tiny_judges):
    """The one deadline rule of every judge's re-asks: a reply that does not read is asked again only while the
    request's deadline has not passed; past it, that reply's error is the result."""
    service, replica = service_of(tiny_models, tiny_judges, reward_kind="judge", judge_readout="generate",
                                  judge_retries=3)
    loop = asyncio.get_running_loop()
    real = loop.time
    late = iter([0.0, 0.0])  # the deadline and the batcher's time left are read on time; then a minute has passed
    loop.time = lambda: real() + next(late, 60.0)
    try:
        result = await service.score(trajectory("g", 0), 30.0)
    finally:
        del loop.time
    await service._batcher.aclose()
    assert isinstance(result, JudgeVerdictError) and result.reply == "I like it"
    assert [item.reask for batch in replica.batches for item in batch] == [None]
