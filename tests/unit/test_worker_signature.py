"""The worker's ``_compute_score`` override takes whatever verl's own takes, today and in the next verl: extra
positional and keyword arguments (upstream proposes a ``validate`` flag) reach verl's method unchanged, on both paths.

verl's ``AgentLoopWorker`` is replaced by a recorder of its ``_compute_score`` arguments, and the RM call by a fixed
score: this tests the override's signature, not verl's reward loop or the RM (the integration tests run those)."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit


def _worker_class():
    from verl_async_rm.integration.agent_loop_worker import AsyncRMWorkerMixin

    class VerlWorker:
        """Stands in for verl's AgentLoopWorker: records what its _compute_score got and scores 1.0."""

        seen: list

        async def _compute_score(self, outputs, kwargs, *args, **options):
            self.seen.append((kwargs, args, options))
            outputs[-1].reward_score = 1.0

    class Worker(AsyncRMWorkerMixin, VerlWorker):
        #: verl's worker keeps the whole config: rollout.n for training groups, val_kwargs.n for validation's
        config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(
            n=4, val_kwargs=SimpleNamespace(n=2))))

        async def _async_rm_scores(self, final, kwargs, trajectory, group_size=None):
            self.group_sizes.append(group_size)
            return {"main": 0.25}, None  # the RM's score (the RM is not what this test checks)

    return Worker


def _output(reward_score=None):
    return SimpleNamespace(reward_score=reward_score, extra_fields={}, response_ids=[1, 2],
                           metrics=SimpleNamespace(compute_score=None))


@pytest.mark.parametrize("scored_by_the_loop", [False, True])
def test_extra_arguments_reach_verls_compute_score(scored_by_the_loop):
    from verl_async_rm.reward_mix import RewardMix

    worker = _worker_class()()
    worker.seen, worker.group_sizes = [], []
    worker._async_rm_mix = RewardMix(rm_weight=2.0, rule_weight=0.5)
    outputs = [_output(0.7 if scored_by_the_loop else None)]
    asyncio.run(worker._compute_score(outputs, {"uid": "u", "extra_info": {}}, "positional", validate=True))
    (kwargs, args, options), = worker.seen
    assert args == ("positional",) and options == {"validate": True}
    assert worker.group_sizes == ([] if scored_by_the_loop else [2])  # a validation group: val_kwargs.n
    if not scored_by_the_loop:  # the RM path: verl's method sees the RM score, the reward is the mix
        assert kwargs["extra_info"]["rm_score"] == 0.25
        assert outputs[-1].reward_score == pytest.approx(2.0 * 0.25 + 0.5 * 1.0)


def test_the_override_accepts_every_argument_of_verls_method():
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from verl_async_rm.integration.agent_loop_worker import AsyncRMWorkerMixin

    ours = inspect.signature(AsyncRMWorkerMixin._compute_score)
    theirs = inspect.signature(AgentLoopWorker._compute_score)
    names = [p.name for p in theirs.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    ours.bind(*names)  # verl's arguments by position
    ours.bind(*names[:3], **{name: None for name in names[3:]}, validate=False)  # and later ones by keyword
