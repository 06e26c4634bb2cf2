"""``AsyncRMAgentLoopManager``: verl's agent-loop manager plus one RM service per RM, for v0 and v1 (what they share:
:mod:`.manager_base`), built by verl with ``.create(config=, llm_client=, ...)``. verl's v0
``AgentLoopManager.__init__`` keeps a preset ``agent_loop_workers_class`` while v1's overwrites it: v0 sets it before
``super().__init__``, v1 (:mod:`.v1`, imported only when a run uses verl's v1 trainer) after."""

from __future__ import annotations

import logging
from typing import Any

import ray
from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.utils.ray_utils import auto_await

from verl_async_rm.integration import trainer_hooks
from verl_async_rm.integration.agent_loop_worker import AsyncRMAgentLoopWorker
from verl_async_rm.integration.checks import verl_v1
from verl_async_rm.integration.drops import apply_drops
from verl_async_rm.integration.manager_base import AsyncRMManagerBase
from verl_async_rm.integration.token_rewards import place_token_rewards

logger = logging.getLogger(__name__)

__all__ = ["AsyncRMAgentLoopManager", "AsyncRMAgentLoopManagerV0"]

class AsyncRMAgentLoopManagerV0(AsyncRMManagerBase, AgentLoopManager):
    """For the v0 trainer (``trainer.use_v1=False``, verl's ``RayPPOTrainer``): ``generate_sequences`` returns the
    scored batch. verl's v0 fit loop gives a manager no phase hook, but it calls ``generate_sequences`` right after
    waking the rollout (``update_weights``) and, for a training batch, sleeps the rollout and updates the policy right
    after it returns: the RMs on the policy's GPUs wake as a call starts and sleep as a training batch returns. A
    training batch is a step (its ``async_rm/*`` go into ``meta_info["timing"]``, logged as ``timing_s/async_rm/...``);
    the validation batches of one ``_validate`` are one validation pass, closed by :mod:`.trainer_hooks`."""

    def __init__(self, config, llm_client, teacher_client=None, reward_loop_worker_handles=None):
        self.agent_loop_workers_class = ray.remote(AsyncRMAgentLoopWorker)
        super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)
        self._async_rm_build(config)
        trainer_hooks.install_v0()

    @auto_await
    async def generate_sequences(self, prompts):
        """verl's ``generate_sequences``, with the RMs awake; a training batch is closed as a step (its metrics in
        ``meta_info["timing"]``, ``on_error`` applied, with ``drop`` the failed trajectories excluded) and the RMs on
        the policy's GPUs put to sleep before it returns."""
        await self.async_rm_wake()
        if prompts.meta_info.get("validate", False):  # one pass of several batches, closed after verl's _validate
            return self._exclude_dropped(await super().generate_sequences(prompts), prompts)
        await self._async_rm_control("begin_step", len(prompts))
        try:
            output = await super().generate_sequences(prompts)
        except BaseException:
            try:
                await self.async_rm_close("train")
            except Exception:  # noqa: BLE001 - the generation error is the one to report
                logger.exception("verl_async_rm: could not close the failed step")
            raise
        await self.async_rm_sleep()  # before the close: the step's metrics hold its wake and its sleep
        metrics = await self.async_rm_close("train", prompts.meta_info.get("global_steps"))
        output = self._exclude_dropped(output, prompts)
        output.meta_info["timing"] = {**output.meta_info.get("timing", {}), **metrics}
        return output

    def _exclude_dropped(self, output: Any, prompts: Any) -> Any:
        """Process RMs' step rewards on their tokens; with ``on_error='drop'`` the failed trajectories excluded (the
        budget was checked by :meth:`async_rm_close`)."""
        place_token_rewards(output)
        if self.async_rm_config.integration.on_error == "drop":
            apply_drops(output, prompts.non_tensor_batch.get("uid"))
        return output


class AsyncRMAgentLoopManager:
    """The class a recipe names; ``create`` returns the v0 or v1 manager that matches ``trainer.use_v1``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("use AsyncRMAgentLoopManager.create(config=..., llm_client=..., ...), as verl does")

    @classmethod
    def create(cls, config, llm_client, teacher_client=None, reward_loop_worker_handles=None):
        impl = AsyncRMAgentLoopManagerV0
        if config.trainer.get("use_v1", True):
            verl_v1()  # a clear error where verl has no v1 trainer
            from verl_async_rm.integration.v1 import AsyncRMAgentLoopManagerV1 as impl
        return impl.create(config=config, llm_client=llm_client, teacher_client=teacher_client,
                           reward_loop_worker_handles=reward_loop_worker_handles)
