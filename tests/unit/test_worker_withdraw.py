"""A trajectory that will never reach the group judges is withdrawn from them by its agent-loop worker (its agent loop
failed before its RM call, or scored itself), so that its siblings are judged at once instead of ``group_wait_s``
after the last of them; one that reached the RM services is never withdrawn, and RMs other than group judges are
never called for it.

verl's ``AgentLoopWorker`` is replaced by a stand-in of its ``_run_agent_loop`` (the agent loop, then its
``_compute_score``) and the RM services by recorders of their calls: this tests the worker's hook; the gate and the
service that take the withdrawal are tested in ``test_group_gate.py`` and ``test_rm_service_judges.py``."""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import pytest

from verl_async_rm.request import Verdict
from verl_async_rm.reward_mix import RewardMix

pytestmark = pytest.mark.unit


class Service:
    """An RM service's handle as the worker uses it: ``score.remote`` (answered at once) and ``withdraw.remote``."""

    def __init__(self) -> None:
        self.scored, self.withdrawn = [], []
        self.score = SimpleNamespace(remote=self._score)
        self.withdraw = SimpleNamespace(remote=self._withdraw)

    def _score(self, request, deadline_s):
        self.scored.append(request.uid)
        answer = concurrent.futures.Future()
        answer.set_result(Verdict(0.5, "[1] {}"))
        return SimpleNamespace(future=lambda: answer)

    async def _withdraw(self, group, group_size):
        self.withdrawn.append((group, group_size))


def worker(services: dict, group_rms: tuple[str, ...]):
    from verl_async_rm.integration.agent_loop_worker import AsyncRMWorkerMixin

    class VerlWorker:
        """verl's ``_run_agent_loop``: the agent loop (``fail='loop'`` raises in it; ``own`` is the reward it sets),
        then ``_compute_score``; ``fail='after'`` raises after the score."""

        async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
            if kwargs.get("fail") == "loop":
                raise RuntimeError("the agent loop failed")
            output = SimpleNamespace(reward_score=kwargs.get("own"), extra_fields={}, response_ids=[1, 2],
                                     prompt_ids=[3], num_turns=2, metrics=SimpleNamespace(compute_score=None))
            await self._compute_score([output], kwargs)
            if kwargs.get("fail") == "after":
                raise RuntimeError("postprocessing failed")
            return output

        async def _compute_score(self, outputs, kwargs):
            pass

    class Worker(AsyncRMWorkerMixin, VerlWorker):
        config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(
            n=4, val_kwargs=SimpleNamespace(n=2))))

    w = Worker()
    asyncio.run(w.async_rm_attach(services, RewardMix(rm_weight=1.0, extra_weights=(("group", 1.0),),
                                                      group_rms=group_rms), request_timeout_s=30.0))
    return w


def run(w, validate=False, **kwargs):
    async def go():
        return await w._run_agent_loop({}, {"validate": validate}, agent_name="a", uid="u7", session_id=0, **kwargs)
    return asyncio.run(go())


@pytest.mark.parametrize("validate, size", [(False, 4), (True, 2)])
def test_a_trajectory_whose_agent_loop_fails_is_withdrawn_from_the_group_judges_only(validate, size):
    main, group = Service(), Service()
    w = worker({"main": main, "group": group}, group_rms=("group",))
    with pytest.raises(RuntimeError, match="the agent loop failed"):
        run(w, validate=validate, fail="loop")
    assert group.withdrawn == [("u7", size)] and main.withdrawn == [] and main.scored == group.scored == []


def test_a_trajectory_that_scored_itself_is_withdrawn_once_and_not_scored():
    main, group = Service(), Service()
    w = worker({"main": main, "group": group}, group_rms=("group",))
    with pytest.raises(RuntimeError, match="postprocessing failed"):
        run(w, own=1.0, fail="after")
    assert group.withdrawn == [("u7", 4)] and main.scored == group.scored == []


def test_a_trajectory_that_reached_the_rms_is_never_withdrawn():
    main, group = Service(), Service()
    w = worker({"main": main, "group": group}, group_rms=("group",))
    with pytest.raises(RuntimeError, match="postprocessing failed"):
        run(w, fail="after")
    assert main.scored == group.scored == ["u7/0"] and group.withdrawn == []


def test_with_no_group_judge_a_failed_trajectory_calls_no_service():
    main = Service()
    w = worker({"main": main}, group_rms=())
    with pytest.raises(RuntimeError, match="the agent loop failed"):
        run(w, fail="loop")
    run(w, own=1.0)
    assert main.withdrawn == [] and main.scored == []
