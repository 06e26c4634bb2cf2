"""verl's v1 trainer (``trainer.use_v1=True``, TransferQueue): the plugin's worker and manager for it. Imported only
when a run uses it (:meth:`~.agent_loop_manager.AsyncRMAgentLoopManager.create`), so the plugin imports and works on
a verl without ``verl.trainer.ppo.v1`` (verl's ``neo`` branch)."""

from __future__ import annotations

from typing import Any

import ray
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
from verl.utils.ray_utils import auto_await

from verl_async_rm.integration import trainer_hooks
from verl_async_rm.integration.manager_base import AsyncRMManagerBase
from verl_async_rm.integration.agent_loop_worker import AsyncRMWorkerMixin
from verl_async_rm.integration.checks import check_v1_trainer

__all__ = ["AsyncRMAgentLoopWorkerTQ", "AsyncRMAgentLoopManagerV1"]


# AgentLoopWorkerTQ is already a Ray actor class (verl decorates it with ``@ray.remote``): subclass the class it wraps.
class AsyncRMAgentLoopWorkerTQ(AsyncRMWorkerMixin, AgentLoopWorkerTQ.__ray_actor_class__):
    """verl's v1 (TransferQueue) ``AgentLoopWorkerTQ`` with the per-trajectory RM hook: a failed RM score fails the
    trajectory's session (verl's own failure path; the manager applies ``on_error`` at the step's end), and a
    token-level reward replaces the trajectory's output (verl builds ``rm_scores`` from it)."""

    _async_rm_fail_session = True
    _async_rm_replace_output = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Must stay: without an __init__ of its own, Ray ships the inherited one by value, and cloudpickle copies
        # verl's class with it (its module name is bound to the ActorClass, so it cannot be found by reference);
        # verl's zero-arg super() in AgentLoopWorkerTQ.__init__ then fails on the copy.
        super().__init__(*args, **kwargs)


class AsyncRMAgentLoopManagerV1(AsyncRMManagerBase, AgentLoopManagerTQ):
    """For the v1 trainer (TransferQueue): ``generate_sequences`` only dispatches. The step boundaries come from
    verl's fit loop (:mod:`.trainer_hooks`); in the ``sync`` trainer mode each batch announces its trajectory count
    (``flush_after``), so its last RM batch leaves the moment its last trajectory arrives."""

    def __init__(self, config, llm_client, teacher_client=None, reward_loop_worker_handles=None):
        super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)
        self.agent_loop_workers_class = ray.remote(AsyncRMAgentLoopWorkerTQ)
        self._async_rm_build(config)
        self._dispatched = False
        trainer_hooks.install()

    def _async_rm_check(self, config: Any) -> None:
        self._trainer_mode = check_v1_trainer(config, self.async_rm_config.integration.on_error)

    def generate_sequences(self, prompts) -> None:
        """Dispatch a batch of prompts (verl v1 semantics: returns once the agent loops are started)."""
        step_size = None  # the trajectories the batch makes; unknown here with a per-prompt __rollout_n__
        if self._trainer_mode == "sync" and "__rollout_n__" not in (keys := set(prompts.keys())):
            rollout = self.config.actor_rollout_ref.rollout
            validate = bool(prompts["validate"]) if "validate" in keys else False
            step_size = len(prompts) * int(rollout.val_kwargs.n if validate else rollout.n)
        if step_size or not self._dispatched:
            self._v1_before_dispatch(step_size)
        super().generate_sequences(prompts)

    @auto_await
    async def _v1_before_dispatch(self, step_size: int | None) -> None:
        if not self._dispatched:  # the first window starts here, not when the pool was built
            await self._async_rm_control("begin_step", step_size)
            self._dispatched = True
        elif step_size:
            await self._async_rm_control("flush_after", step_size)

