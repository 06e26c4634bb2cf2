"""Agent-loop workers that send each finished trajectory to every RM service the moment its agent loop ends (the hook
for both trainers; the v1 worker class is in :mod:`.v1`, imported only when a run uses verl's v1 trainer).

The override of verl's ``AgentLoopWorker._compute_score`` (in the trajectory's own task) awaits every RM's score,
runs verl's own ``_compute_score`` (the reward manager, which sees the scores in ``extra_info``) only when the reward
uses its rule (``RewardMix.uses_rule``), and mixes both: with no rule, a trajectory makes two Ray calls (worker ->
RM service -> replica), not three. A trajectory an RM failed has no reward: on v1 its session raises (verl's
``failure`` path; the manager applies ``on_error`` at the step's end); on v0 ``on_error='drop'`` gives it a NaN reward
flagged ``rm_dropped``."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import ray
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

from verl_async_rm.errors import AsyncRMError, RMServiceLostError
from verl_async_rm.integration.drops import Failure, PhaseRecord, PhaseRecords
from verl_async_rm.reward_mix import RewardMix, with_rm_scores
from verl_async_rm.integration.token_rewards import TOKEN_REWARDS_KEY, token_placement, with_token_rewards
from verl_async_rm.request import RMRequest, Score, ScoreResult, StepRewards
from verl_async_rm.service.client import score_with_timeout

logger = logging.getLogger(__name__)

#: The phase of the trajectory whose task is running: verl 0.9.1 passes ``validate`` to ``_agent_loop_postprocess`` but
#: not to ``_compute_score``, so the worker sets it around that call (each trajectory runs in its own asyncio task);
#: where verl passes ``validate=`` to ``_compute_score`` (verl PR #7217), that value is read instead.
_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar("async_rm_phase", default="train")
#: Whether the running trajectory has gone to the RM services, or been withdrawn from its group judges: a flag set
#: by ``_run_agent_loop`` (a list, so that tasks it starts share it). One whose agent loop fails before is withdrawn.
_SENT: contextvars.ContextVar[list[bool]] = contextvars.ContextVar("async_rm_sent")
#: Longest wait for the group judges to take a withdrawal.
_WITHDRAW_S = 30.0

__all__ = ["AsyncRMWorkerMixin", "AsyncRMAgentLoopWorker"]


class AsyncRMWorkerMixin:
    """The per-trajectory reward hook; mixed into verl's v0 and v1 agent-loop workers."""

    _async_rm_services: Mapping[str, Any] = MappingProxyType({})  #: set by async_rm_attach
    _async_rm_mix: RewardMix | None = None
    _async_rm_combine: Any = None
    _async_rm_timeout_s: float = 0.0
    _async_rm_on_error: str = "raise"
    #: v1: a failed RM score always fails the trajectory's session (verl's own failure path); the manager applies
    #: ``on_error`` at the step's end. v0: ``on_error='drop'`` hands the error on to the reward manager instead.
    _async_rm_fail_session: bool = False
    _async_rm_records: PhaseRecords | None = None
    #: v1: a token-level reward replaces the trajectory's output (verl builds ``rm_scores`` from it); v0: it travels
    #: in ``extra_fields`` to the manager, which rewrites ``rm_scores``.
    _async_rm_replace_output: bool = False

    async def async_rm_attach(self, services: Mapping[str, Any], mix: RewardMix, request_timeout_s: float,
                              on_error: str = "raise") -> bool:
        """Give this worker the RM services it scores with, by RM name (``main`` first), and how their scores mix
        with the reward manager's (by the manager after creation, and after a service restart)."""
        self._async_rm_services = dict(services)
        self._async_rm_mix = mix
        self._async_rm_combine = mix.load_combine_fn()
        self._async_rm_timeout_s = float(request_timeout_s)
        self._async_rm_on_error = on_error
        return True

    async def async_rm_pop_record(self, phase: str) -> PhaseRecord:
        """This worker's record of ``phase`` since the previous call (collected by the manager at a step's end)."""
        return self._records().pop(phase)

    def _records(self) -> PhaseRecords:
        if self._async_rm_records is None:
            self._async_rm_records = PhaseRecords()
        return self._async_rm_records

    async def _run_agent_loop(self, sampling_params: dict, trajectory: dict, *args: Any, **kwargs: Any) -> Any:
        """verl's run of one trajectory; one whose agent loop fails before its RM call is withdrawn from the group
        judges, so that its siblings are judged without waiting ``group_wait_s`` for it."""
        sent = [False]
        token = _SENT.set(sent)
        try:
            return await super()._run_agent_loop(sampling_params, trajectory, *args, **kwargs)  # type: ignore[misc]
        except Exception:
            if not sent[0]:
                await self._async_rm_withdraw(kwargs, bool(trajectory.get("validate")))
            raise
        finally:
            _SENT.reset(token)

    async def _agent_loop_postprocess(self, output: Any, validate: Any, **kwargs: Any) -> Any:
        token = _PHASE.set("val" if validate else "train")
        try:  # v0 returns the processed output, v1 writes it to TransferQueue
            return await super()._agent_loop_postprocess(output, validate, **kwargs)  # type: ignore[misc]
        finally:
            _PHASE.reset(token)

    async def _compute_score(self, outputs: list, kwargs: dict, *args: Any, **options: Any) -> None:
        # verl's later arguments (`validate=`, verl PR #7217) go on to verl's own method unchanged
        final = outputs[-1]
        validate = options.get("validate")
        phase = _PHASE.get() if validate is None else ("val" if validate else "train")
        if final.reward_score is not None:  # the agent loop scored itself: no RM call, as verl does
            await self._async_rm_withdraw(kwargs, phase == "val")
            await super()._compute_score(outputs, kwargs, *args, **options)  # type: ignore[misc]
            return
        start = time.perf_counter()
        records = self._records()
        trajectory = f"{kwargs.get('uid', '?')}/{kwargs.get('session_id', 0)}"
        scores, failure = await self._async_rm_scores(final, kwargs, trajectory, self._group_size(phase == "val"))
        error = None
        if failure is not None:
            error = _describe(failure)
            records.failed(phase, Failure(trajectory, _int_or_none(kwargs.get("global_steps")), error,
                                         cause=Failure.portable(failure)))
            if self._async_rm_fail_session or self._async_rm_on_error != "drop":
                raise failure
            logger.warning("verl_async_rm: no RM score for trajectory %s (dropped): %s", trajectory, error)
        else:
            records.scored(phase)
        mix = self._async_rm_mix
        extra_info = kwargs.get("extra_info")
        manager_result: dict[str, Any] = {}
        if mix.uses_rule:  # the reward manager's function sees the RM scores in extra_info (a copy)
            extra_info = with_rm_scores(extra_info, scores)
            await super()._compute_score(outputs, {**kwargs, "extra_info": extra_info}, *args,  # type: ignore[misc]
                                         **options)
            manager_result = {"reward_score": final.reward_score,
                              "reward_extra_info": final.extra_fields.get("reward_extra_info")}
        final.reward_score, final.extra_fields["reward_extra_info"] = mix.finish(
            manager_result, scores, data_source=kwargs.get("data_source"), extra_info=extra_info,
            fn=self._async_rm_combine, error=error, flag_drops=self._async_rm_on_error == "drop")
        # verl times its own reward-loop call only: the whole hook is the trajectory's wait for its reward
        final.metrics.compute_score = time.perf_counter() - start
        if error is None and any(isinstance(s, StepRewards) for s in scores.values()):
            placement = token_placement(final.reward_score, scores, mix.weights, len(final.response_ids))
            if self._async_rm_replace_output:
                outputs[-1] = with_token_rewards(final, placement)
            else:
                final.extra_fields[TOKEN_REWARDS_KEY] = placement
        elif mix.token_level and not self._async_rm_replace_output:
            final.extra_fields[TOKEN_REWARDS_KEY] = None  # verl stacks the same extra_fields for every sample

    def _group_size(self, validate: bool) -> int | None:
        """The size of a group of trajectories (``rollout.n``), which a group judge waits for."""
        rollout = self.config.actor_rollout_ref.rollout  # type: ignore[attr-defined] - verl's worker's whole config
        n = rollout.val_kwargs.n if validate else rollout.n
        return None if n is None else int(n)

    async def _async_rm_withdraw(self, kwargs: dict, validate: bool) -> None:
        """Tell the group judges that this trajectory will never reach them (its agent loop failed, or scored
        itself): its siblings are judged without it as soon as they are in."""
        _mark_sent()
        mix = self._async_rm_mix
        judges = [self._async_rm_services[name] for name in (mix.group_rms if mix is not None else ())
                  if name in self._async_rm_services]
        if not judges:
            return
        group = str(kwargs.get("uid", "?"))
        try:
            await asyncio.wait_for(asyncio.gather(
                *(judge.withdraw.remote(group, self._group_size(validate)) for judge in judges)), _WITHDRAW_S)
        except Exception as err:  # noqa: BLE001 - the trajectory's own failure is what its caller must see
            logger.warning("verl_async_rm: could not withdraw a trajectory of group %s from the group judges (%s): its "
                           "siblings are judged group_wait_s after the last of them", group, _describe(err))

    async def _async_rm_scores(self, final: Any, kwargs: dict, trajectory: str, group_size: int | None = None
                               ) -> tuple[dict[str, Score], AsyncRMError | None]:
        """The trajectory's score from every RM at once (ready when the last answers), as the replicas made them,
        and the first failure (an RM's error, or its service lost). ``group_size``: its group's size."""
        if not self._async_rm_services or self._async_rm_mix is None:
            raise AsyncRMError("this agent-loop worker has no RM service attached: build it through "
                               "verl_async_rm.AsyncRMAgentLoopManager.create(...)")
        reference = kwargs.get("reward_model")  # verl's datasets: {"ground_truth": ..., "style": ...}
        request = RMRequest.from_agent_loop_output(
            final, uid=trajectory, raw_prompt=kwargs.get("raw_prompt"), group=str(kwargs.get("uid", "?")),
            ground_truth=reference.get("ground_truth") if isinstance(reference, Mapping) else None,
            group_size=group_size)
        names = list(self._async_rm_services)
        _mark_sent()
        answers: list[ScoreResult | BaseException] = await asyncio.gather(
            *(score_with_timeout(service, request, timeout_s=self._async_rm_timeout_s)
              for service in self._async_rm_services.values()), return_exceptions=True)
        scores: dict[str, Score] = {}
        failure: AsyncRMError | None = None
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, ray.exceptions.RayActorError):
                lost = RMServiceLostError(
                    f"the RM service of RM {name!r} died while trajectory {request.uid} waited for its score "
                    f"({answer}); the agent-loop manager starts a new one at the next step")
                lost.__cause__, answer = answer, lost
            if not isinstance(answer, BaseException):
                scores[name] = answer
            elif isinstance(answer, AsyncRMError):
                if len(names) > 1:
                    answer.add_note(f"RM {name!r}")
                failure = failure or answer
            else:
                raise answer  # not an RM failure (a cancellation, a bug): never recorded as a dropped score
        return scores, failure


class AsyncRMAgentLoopWorker(AsyncRMWorkerMixin, AgentLoopWorker):
    """verl's v0 ``AgentLoopWorker`` with the per-trajectory RM hook."""


def _mark_sent() -> None:
    sent = _SENT.get(None)
    if sent is not None:
        sent[0] = True


def _describe(err: BaseException) -> str:
    """``Type: message``, after the RM it came from when there are several (``RM 'safety': ...``)."""
    where = "".join(f"{note}: " for note in getattr(err, "__notes__", ()))
    return f"{where}{type(err).__name__}: {err}"[:500]


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
